//! `check`'s QDQ rows: every activation QDQ and the KV cache's per-head fp8 QDQ on the GPU
//! against the CPU reference in `ops::dequant` on the same input, bit for bit, in f32 and bf16.
//! The inputs have what the edge cases need: an all-zero row, a row far beyond fp8's range
//! (saturation), tiny values (subnormal grids), -0.0, and a width that is not a multiple of
//! the fp8 group.

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use exactscore_server::ops::{fp8_head_qdq, ActivationQdq, HeadScales};

use crate::bits_equal;

/// `[rows, k]` random values with the edge rows, on `device` in `dtype`.
fn input(rows: usize, k: usize, dtype: DType, device: &Device) -> Result<Tensor> {
    let mut v = Tensor::randn(0f32, 2.0, (rows, k), &Device::Cpu)?.to_vec2::<f32>()?;
    v[0].iter_mut().for_each(|x| *x = 0.0);
    v[1].iter_mut().for_each(|x| *x *= 1e4);
    v[2].iter_mut().for_each(|x| *x *= 1e-6);
    v[3][0] = -0.0;
    Ok(Tensor::new(v, &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

/// Prints one line per case; returns the number that differ from the CPU.
pub fn run(device: &Device) -> Result<usize> {
    println!("QDQ kernels vs the CPU reference, bitwise (f32 / bf16):");
    println!("| QDQ | f32 | bf16 | |");
    println!("|---|---|---|---|");
    let activations = [
        ActivationQdq::Fp8PerToken,
        ActivationQdq::Fp8Static { scale: 0.037 },
        ActivationQdq::Fp8PerTokenGroup {
            group: 128,
            power_of_two: false,
        },
        ActivationQdq::Fp8PerTokenGroup {
            group: 128,
            power_of_two: true,
        },
        ActivationQdq::Nvfp4 {
            global_scale: 301.0,
        },
        ActivationQdq::Int8PerToken,
    ];
    let mut failures = 0;
    let mut row = |name: String, same: [bool; 2]| {
        let ok = same.iter().all(|&s| s);
        failures += usize::from(!ok);
        println!(
            "| {name} | {} | {} | {} |",
            same[0],
            same[1],
            if ok { "ok" } else { "FAIL" }
        );
    };
    for qdq in &activations {
        let mut same = [true; 2];
        for (i, dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
            // 1,000 inputs: the last fp8 group of a row is short (1000 = 7 · 128 + 104).
            let k = if matches!(qdq, ActivationQdq::Nvfp4 { .. }) {
                1024
            } else {
                1000
            };
            let x = input(37, k, dtype, device)?;
            same[i] = bits_equal(&qdq.apply(&x)?, &qdq.apply(&x.to_device(&Device::Cpu)?)?)?;
        }
        row(format!("{} activations", qdq.describe()), same);
    }
    // Keys or values as attention holds them: [batch, kv heads, tokens, head dim], heads axis 1.
    let per_head = vec![0.011, 0.3, 2.5, 0.07];
    for (name, scales) in [
        ("fp8 KV, one static scale", HeadScales::Static(vec![0.05])),
        ("fp8 KV, static per head", HeadScales::Static(per_head)),
        ("fp8 KV, dynamic per head (simulation)", HeadScales::AbsMax),
    ] {
        let mut same = [true; 2];
        for (i, dtype) in [DType::F32, DType::BF16].into_iter().enumerate() {
            let x = input(2 * 4 * 19, 64, dtype, device)?.reshape((2, 4, 19, 64))?;
            let gpu = fp8_head_qdq(&x, 1, &scales)?;
            let cpu = fp8_head_qdq(&x.to_device(&Device::Cpu)?, 1, &scales)?;
            same[i] = bits_equal(&gpu, &cpu)?;
        }
        row(name.into(), same);
    }
    Ok(failures)
}
