//! The RoPE keys, as transformers' `standardize_rope_params` reads them: v5 puts everything in
//! `rope_parameters`; v4 has `rope_theta` at the top level and the schedule in `rope_scaling`
//! (whose type key is `rope_type`, or `type` in old files).

use serde_json::Value;

use super::shared::{optional_f64, positive_finite};
use crate::checkpoint::LoadError;
use crate::model::rope::{Rope, RopeScaling};

/// The RoPE that `v5` (`rope_parameters`) or else `v4_scaling` and `v4_theta` describe; `root`
/// gives the context lengths that transformers fills in.
pub(super) fn parse_rope(
    v5: &Option<Value>,
    v4_scaling: &Option<Value>,
    v4_theta: Option<f64>,
    root: &Value,
) -> Result<Rope, LoadError> {
    let (field, params) = match (v5, v4_scaling) {
        (Some(p), _) => ("rope_parameters", Some(p)),
        (None, Some(Value::Null)) | (None, None) => ("rope_scaling", None),
        (None, Some(s)) => ("rope_scaling", Some(s)),
    };
    let rope_type = params
        .and_then(|p| p.get("rope_type").or_else(|| p.get("type")))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let schedule = Schedule {
        field,
        params,
        rope_type,
        root,
    };
    let theta = schedule.theta(v4_theta)?;
    let scaling = match rope_type {
        "default" => RopeScaling::Default,
        "linear" => RopeScaling::Linear {
            factor: schedule.need("factor")? as f32,
        },
        "dynamic" => RopeScaling::DynamicNtk {
            factor: schedule.need("factor")?,
            max_position_embeddings: schedule.max_positions()? as usize,
        },
        "llama3" => schedule.llama3()?,
        "yarn" => schedule.yarn()?,
        "proportional" => schedule.proportional()?,
        other => {
            return Err(LoadError::config(
                format!("{field}.rope_type"),
                format!(
                    "`{other}` is not supported (supported: default, linear, dynamic, llama3, \
                     yarn, proportional)"
                ),
            ))
        }
    };
    Ok(Rope { theta, scaling })
}

/// The parameters of one schedule, `params` under the key `field`.
struct Schedule<'a> {
    field: &'static str,
    params: Option<&'a Value>,
    rope_type: &'a str,
    root: &'a Value,
}

impl Schedule<'_> {
    fn get(&self, key: &str) -> Option<f64> {
        self.params.and_then(|p| p.get(key)).and_then(Value::as_f64)
    }

    /// The schedule's own `rope_theta`, else the top-level one.
    fn theta(&self, v4_theta: Option<f64>) -> Result<f64, LoadError> {
        let theta_field = match self.get("rope_theta") {
            Some(_) => format!("{}.rope_theta", self.field),
            None => "rope_theta".into(),
        };
        let theta = self.get("rope_theta").or(v4_theta).ok_or_else(|| {
            LoadError::config(
                "rope_theta",
                "missing (neither rope_parameters.rope_theta nor rope_theta)",
            )
        })?;
        positive_finite(theta, &theta_field)
    }

    /// A parameter the schedule cannot do without.
    fn need(&self, key: &str) -> Result<f64, LoadError> {
        let name = format!("{}.{key}", self.field);
        let value = self.get(key).ok_or_else(|| {
            LoadError::config(&name, format!("missing for rope_type {}", self.rope_type))
        })?;
        positive_finite(value, &name)
    }

    /// Gemma 4's proportional RoPE: `factor` (default 1) and `partial_rotary_factor` (default
    /// 1: every pair rotates), the share of the pairs that rotate.
    fn proportional(&self) -> Result<RopeScaling, LoadError> {
        let factor = match self.get("factor") {
            Some(_) => self.need("factor")?,
            None => 1.0,
        };
        let name = format!("{}.partial_rotary_factor", self.field);
        let partial_rotary_factor = self.get("partial_rotary_factor").unwrap_or(1.0);
        if !(0.0..=1.0).contains(&partial_rotary_factor) {
            return Err(LoadError::config(
                name,
                format!("{partial_rotary_factor} is not in [0, 1]"),
            ));
        }
        Ok(RopeScaling::Proportional {
            factor: factor as f32,
            partial_rotary_factor,
        })
    }

    fn max_positions(&self) -> Result<f64, LoadError> {
        optional_f64(self.root, "max_position_embeddings")?.ok_or_else(|| {
            LoadError::config(
                "max_position_embeddings",
                format!("missing; rope_type {} needs it", self.rope_type),
            )
        })
    }

    /// The pretraining context: a top-level `original_max_position_embeddings` wins (Phi-3
    /// style), then the schedule's own, then `max_position_embeddings`.
    fn original_context(&self) -> Result<f64, LoadError> {
        match optional_f64(self.root, "original_max_position_embeddings")? {
            Some(v) => Ok(v),
            None => match self.get("original_max_position_embeddings") {
                Some(_) => self.need("original_max_position_embeddings"),
                None => self.max_positions(),
            },
        }
    }

    /// Each factor is a divisor of the schedule (transformers' own checks: factor >= 1 and
    /// low_freq_factor < high_freq_factor, else the smoothing divides by zero or less).
    fn llama3(&self) -> Result<RopeScaling, LoadError> {
        let factor = self.need("factor")? as f32;
        if factor < 1.0 {
            return Err(LoadError::config(
                format!("{}.factor", self.field),
                format!("{factor} is out of range (>= 1)"),
            ));
        }
        let (low_freq_factor, high_freq_factor) = (
            self.need("low_freq_factor")? as f32,
            self.need("high_freq_factor")? as f32,
        );
        if low_freq_factor >= high_freq_factor {
            return Err(LoadError::config(
                format!("{}.high_freq_factor", self.field),
                format!(
                    "{high_freq_factor} must be greater than low_freq_factor = {low_freq_factor}"
                ),
            ));
        }
        Ok(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings: self.original_context()? as f32,
        })
    }

    fn yarn(&self) -> Result<RopeScaling, LoadError> {
        let original = self.original_context()?;
        // An explicit null factor is the ratio of the two contexts (DeepSeek-V3 style).
        let factor = match self.params.and_then(|p| p.get("factor")) {
            Some(Value::Null) => self.max_positions()? / original,
            _ => self.need("factor")?,
        };
        // Unset betas and zeros fall back to the paper's 32 and 1, as in transformers.
        let beta = |key: &str, default: f64| self.get(key).filter(|b| *b != 0.0).unwrap_or(default);
        Ok(RopeScaling::Yarn {
            factor,
            attention_factor: positive_finite(
                self.yarn_attention_factor(factor)?,
                &format!("{}.attention_factor", self.field),
            )?,
            beta_fast: beta("beta_fast", 32.0),
            beta_slow: beta("beta_slow", 1.0),
            original_max_position_embeddings: original,
            truncate: self
                .params
                .and_then(|p| p.get("truncate"))
                .and_then(Value::as_bool)
                .unwrap_or(true),
        })
    }

    /// The file's `attention_factor`, else the one `mscale` and `mscale_all_dim` give.
    fn yarn_attention_factor(&self, factor: f64) -> Result<f64, LoadError> {
        let mscale = |m: f64| match factor {
            f if f <= 1.0 => 1.0,
            f => 0.1 * m * f.ln() + 1.0,
        };
        Ok(match self.get("attention_factor") {
            Some(_) => self.need("attention_factor")?,
            None => match (
                self.get("mscale").filter(|m| *m != 0.0),
                self.get("mscale_all_dim").filter(|m| *m != 0.0),
            ) {
                (Some(m), Some(all)) => mscale(m) / mscale(all),
                _ => mscale(1.0),
            },
        })
    }
}

/// `int(head_dim * partial_rotary_factor)`: the factor of `rope_parameters` wins over the
/// top-level one (transformers' `standardize_rope_params` folds the latter in only where the
/// former is absent); `default` where neither is given (the config class's `setdefault`).
pub(super) fn partial_rotary_dim(
    root: &Value,
    head_dim: usize,
    default: f64,
) -> Result<usize, LoadError> {
    let nested = root
        .get("rope_parameters")
        .filter(|p| p.is_object())
        .map(|p| optional_f64(p, "partial_rotary_factor"))
        .transpose()
        .map_err(|_| {
            LoadError::config(
                "rope_parameters.partial_rotary_factor",
                "not a positive number",
            )
        })?
        .flatten();
    let factor = match nested {
        Some(f) => f,
        None => optional_f64(root, "partial_rotary_factor")?.unwrap_or(default),
    };
    let dim = (head_dim as f64 * factor).floor() as usize;
    if factor > 1.0 || dim == 0 || !dim.is_multiple_of(2) {
        return Err(LoadError::config(
            "partial_rotary_factor",
            format!(
                "{factor} of head_dim {head_dim} gives {dim} rotary dimensions (must be even, \
                 at least 2 and at most head_dim)"
            ),
        ));
    }
    Ok(dim)
}
