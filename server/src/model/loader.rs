//! Where a block's tensors come from (candle's `VarBuilder`): the checkpoint, its quantization
//! config, the options the block is built with, and the prefix of the block's tensor names.
//! Each block's `load` takes one, pushed to its own prefix with [`Loader::pp`].

use candle_core::{DType, Device, Tensor};

use crate::checkpoint::{Checkpoint, LoadError};
use crate::quant::{
    load_linear, Fp8Matmul, KvCacheQdq, KvCacheScheme, LinearOptions, QuantLinear,
    QuantizationConfig, SCALE_DTYPES,
};

#[derive(Clone)]
pub struct Loader<'a> {
    ckpt: &'a Checkpoint,
    quant: Option<&'a QuantizationConfig>,
    opts: &'a LinearOptions,
    prefix: String,
    /// Whether Linears may run on the fp8 tensor cores ([`Self::experts`] turns it off).
    fp8_tensor_cores: bool,
}

impl<'a> Loader<'a> {
    /// A loader at the root of the checkpoint's names.
    pub fn new(
        ckpt: &'a Checkpoint,
        quant: Option<&'a QuantizationConfig>,
        opts: &'a LinearOptions,
    ) -> Self {
        Self {
            ckpt,
            quant,
            opts,
            prefix: String::new(),
            fp8_tensor_cores: true,
        }
    }

    /// The loader of a mixture's experts under `name`: their Linears emulate fp8 activations
    /// (whatever `--fp8-matmul` says), since the experts multiply as one stack of GEMMs over a
    /// shared QDQ'd input, which the fp8 tensor-core GEMM does not do yet.
    pub fn experts(&self, name: impl std::fmt::Display) -> Self {
        Self {
            fp8_tensor_cores: false,
            ..self.pp(name)
        }
    }

    /// The loader of the sub-block `name` (`model` → `model.layers` → `model.layers.3`).
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        Self {
            prefix: self.name(&name.to_string()),
            ..self.clone()
        }
    }

    /// The full name of `name` under this prefix.
    pub fn name(&self, name: &str) -> String {
        match self.prefix.as_str() {
            "" => name.to_string(),
            prefix => format!("{prefix}.{name}"),
        }
    }

    /// The prefix of this loader's names (`model.layers.3.self_attn`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The checkpoint's `kv_cache_scheme`, where it has one.
    pub fn kv_cache_scheme(&self) -> Option<&KvCacheScheme> {
        self.quant.and_then(|q| q.kv_cache.as_ref())
    }

    /// Whether the checkpoint is gpt-oss's native MXFP4 (`quant_method: mxfp4`).
    pub fn native_mxfp4(&self) -> bool {
        self.quant.is_some_and(|q| q.native_mxfp4)
    }

    /// The KV-cache QDQ of the attention under this prefix with `num_kv_heads` heads
    /// ([`KvCacheQdq::load`]).
    pub fn kv_cache(&self, num_kv_heads: usize) -> Result<Option<KvCacheQdq>, LoadError> {
        KvCacheQdq::load(
            self.ckpt,
            &self.prefix,
            num_kv_heads,
            self.kv_cache_scheme(),
            self.opts.kv_cache,
        )
    }

    /// Refuses a KV-cache quantization for the attention under this prefix, of kind `what`.
    pub fn refuse_kv_cache(&self, what: &str) -> Result<(), LoadError> {
        KvCacheQdq::refuse(
            self.kv_cache_scheme(),
            self.opts.kv_cache,
            &self.prefix,
            what,
        )
    }

    pub fn options(&self) -> &LinearOptions {
        self.opts
    }

    pub fn checkpoint(&self) -> &Checkpoint {
        self.ckpt
    }

    /// The Linear `name` of `(out, in)` features, in the format the quantization config gives
    /// it (dense when there is none), on the loader's device.
    pub fn linear(
        &self,
        name: &str,
        shape: (usize, usize),
        bias: bool,
    ) -> Result<QuantLinear, LoadError> {
        let name = self.name(name);
        let scheme = match self.quant {
            Some(q) => q.scheme_for(&name, "Linear")?,
            None => None,
        };
        match self.fp8_tensor_cores {
            true => load_linear(self.ckpt, &name, shape, bias, scheme, self.opts),
            false => {
                let opts = LinearOptions {
                    fp8_matmul: Fp8Matmul::Emulated,
                    ..self.opts.clone()
                };
                load_linear(self.ckpt, &name, shape, bias, scheme, &opts)
            }
        }
    }

    /// The float tensor `name` of `shape`, in the compute dtype on the loader's device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor, LoadError> {
        self.get_as(name, shape, self.opts.dtype, &self.opts.device)
    }

    /// The float tensor `name` of `shape` as `dtype` on `device` (converted on the CPU).
    pub fn get_as(
        &self,
        name: &str,
        shape: &[usize],
        dtype: DType,
        device: &Device,
    ) -> Result<Tensor, LoadError> {
        self.ckpt
            .tensor_as(&self.name(name), SCALE_DTYPES, Some(shape), dtype, device)
    }
}
