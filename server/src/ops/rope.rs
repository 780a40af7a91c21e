//! The RoPE family, on a GPU: rotations of the projections' token-major layout `[tokens, heads,
//! head_dim]` for the flash kernels, the per-head norm fused with them, and MLA's flash inputs.

use candle_core::{Result, Tensor};

use super::gpu_only;

super::gpu_entry_points!(rope {
    fn rope_rotate_half(x: &Tensor, positions: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor>;
    fn head_norm_rope(
        x: &Tensor,
        norm: Option<(&Tensor, f64)>,
        rot: usize,
        positions: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
    ) -> Result<Option<Tensor>>;
    fn mla_flash_inputs(
        q: &Tensor,
        kv: &Tensor,
        k_rot: &Tensor,
        positions: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        query_scale: Option<&Tensor>,
        dims: (usize, usize, usize, usize, usize, bool),
        values: bool,
    ) -> Result<(Tensor, Tensor, Option<Tensor>)>;
});

/// RoPE (`rotate_half` convention) of `x` `[tokens, heads, head_dim]` at `positions[token]` of
/// the `cos`/`sin` tables, for [`super::flash_attention`]: a GPU kernel only.
pub fn rope_rotate_half(
    x: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    gpu_only("rope_rotate_half", x)?;
    gpu::rope_rotate_half(x, positions, cos, sin)
}

/// `x` `[tokens, heads, head_dim]` with each head normed (RMSNorm, `norm`'s weight and eps,
/// where given: Qwen3's and Gemma's q/k norms) and its first `rotary_dim` values rotated as
/// [`rope_rotate_half`] rotates them, the rest passed through, for [`super::flash_attention`]. Partial
/// rotary runs as one kernel where the heads allow it (the composition copies the rotary part
/// out and back); full rotary as the norm then [`rope_rotate_half`], which is as fast (a lane
/// of the fused kernel rotates 8 values where a thread of the RoPE kernel rotates 8 pairs:
/// 0.147 against 0.139 ms on Qwen3's queries at 16,384 tokens, H200). The same bits either
/// way (`check`). A GPU op only.
pub fn head_norm_rope(
    x: &Tensor,
    norm: Option<(&Tensor, f64)>,
    rotary_dim: usize,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<Tensor> {
    gpu_only("head_norm_rope", x)?;
    let partial = rotary_dim < x.dims().last().copied().unwrap_or(0);
    if partial {
        if let Some(out) = gpu::head_norm_rope(x, norm, rotary_dim, positions, cos, sin)? {
            return Ok(out);
        }
    }
    let x = match norm {
        Some((weight, eps)) => super::rms_norm(x, weight, eps, None)?,
        None => x.clone(),
    };
    rotate_leading(&x, rotary_dim, |x| rope_rotate_half(x, positions, cos, sin))
}

/// `rotate` applied to the first `rotary_dim` values of `x`'s last axis, the others passed
/// through (partial rotary embeddings).
pub fn rotate_leading(
    x: &Tensor,
    rotary_dim: usize,
    rotate: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    let last = x.rank() - 1;
    let dim = x.dims()[last];
    if rotary_dim == dim {
        return rotate(x);
    }
    let rotated = rotate(&x.narrow(last, 0, rotary_dim)?.contiguous()?)?;
    let pass = x.narrow(last, rotary_dim, dim - rotary_dim)?;
    Tensor::cat(&[rotated, pass], last)?.contiguous()
}

/// The shapes of an MLA layer's heads for [`mla_flash_inputs`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MlaHeads {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub value: usize,
    /// The flash kernel's head size every head is zero-padded to.
    pub width: usize,
    /// DeepSeek's paired rotary layout (rotated as its de-interleaved copy).
    pub interleave: bool,
}

/// MLA's flash-kernel inputs in one pass: `q` `[tokens, heads * (nope + rope)]` with its
/// rotary part rotated (and times `query_scale[token]`, Mistral 4's, where given), `k` the
/// `kv` nope part with the shared `k_rot` `[tokens, rope]` rotated, `v` the value part, each
/// `[tokens, heads, width]` zero-padded: the bits of the rope, concatenation, scaling and
/// padding it replaces (a GPU kernel only). Values that fill `width` (GLM-4.7-Flash's 256)
/// come back as a view of `kv`, which the flash kernel reads in place: no copy of a fifth of
/// the pass's bytes.
#[allow(clippy::too_many_arguments)]
pub fn mla_flash_inputs(
    q: &Tensor,
    kv: &Tensor,
    k_rot: &Tensor,
    positions: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    query_scale: Option<&Tensor>,
    h: MlaHeads,
) -> Result<(Tensor, Tensor, Tensor)> {
    gpu_only("mla_flash_inputs", q)?;
    let dims = (h.heads, h.nope, h.rope, h.value, h.width, h.interleave);
    let in_place = h.value == h.width;
    let (q, k, v) = gpu::mla_flash_inputs(
        q,
        kv,
        k_rot,
        positions,
        cos,
        sin,
        query_scale,
        dims,
        !in_place,
    )?;
    let v = match v {
        Some(v) => v,
        None => kv
            .reshape((kv.dims()[0], h.heads, h.nope + h.value))?
            .narrow(2, h.nope, h.value)?,
    };
    Ok((q, k, v))
}
