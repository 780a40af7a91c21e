//! Launch of kernels/embedding.cu: the embedding lookup.
// Kernel launches are FFI: the argument lists below must match the kernel signatures.

use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{bail, DType, Result, Tensor};

use super::module::{kernel, EMBEDDING};
use super::{grid_rows, rows_of_vectors, vector_kernel_name, with_slice, wrap};

/// Rows `ids` (u32, every id < rows of `table`) of `table` `[rows, cols]`: the embedding lookup
/// without candle's `index_select`, whose module is PTX the driver would JIT-compile at start-up.
pub fn gather_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let (_, cols) = table.dims2()?;
    let n = ids.elem_count();
    if n == 0 || cols == 0 {
        return Tensor::zeros((n, cols), table.dtype(), table.device());
    }
    let vectors = rows_of_vectors(cols, &[table]);
    let name = vector_kernel_name("gather_rows", vectors, table.dtype());
    with_float_type!(table.dtype(), T => with_slice::<T, _>(table, |ts, to, dev| {
        with_slice::<u32, _>(ids, |is, io, _| {
            let func = kernel(dev, &EMBEDDING, &name)?;
            // SAFETY: the kernel writes every element.
            let out = unsafe { dev.alloc::<T>(n * cols) }?;
            let (ts, is) = (ts.slice(to..), is.slice(io..));
            let c32 = cols as i32;
            let mut b = func.builder();
            b.arg(&ts).arg(&is).arg(&out).arg(&c32);
            // SAFETY: arguments match `gather_rows[_v8]_*` (a block per id; 16-byte vectors
            // only where rows_of_vectors allows them); the caller checked every id.
            unsafe { b.launch(grid_rows(n)) }.w()?;
            Ok(wrap(out, dev, (n, cols)))
        })
    }))
}
