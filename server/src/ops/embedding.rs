//! The embedding family: the lookup of token rows in the embedding table.

use candle_core::{Result, Tensor};

super::gpu_entry_points!(embedding {
    fn gather_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor>;
});

/// Rows `ids` (u32, already checked against the table) of `table` `[rows, cols]`: the embedding
/// lookup.
pub fn gather_rows(table: &Tensor, ids: &Tensor) -> Result<Tensor> {
    if table.device().is_cuda() {
        return gpu::gather_rows(table, ids);
    }
    table.index_select(ids, 0)
}
