//! Bit-level decoding and round-to-nearest-even encoding of the small float formats that
//! compressed-tensors uses: float8 e4m3fn, fp4 e2m1, and bfloat16 rounding.

/// Largest finite e4m3fn value.
pub const FP8_E4M3_MAX: f32 = 448.0;
/// Largest fp4 e2m1 value.
pub const FP4_E2M1_MAX: f32 = 6.0;

/// Decodes one float8 e4m3fn byte (bias 7, no infinities, 0x7F/0xFF are NaN).
pub fn fp8_e4m3_to_f32(byte: u8) -> f32 {
    let sign = if byte & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = ((byte >> 3) & 0x0F) as i32;
    let mantissa = (byte & 0x07) as f32;
    let magnitude = match exp {
        0 => mantissa / 8.0 * 2f32.powi(-6),
        15 if mantissa == 7.0 => f32::NAN,
        _ => (1.0 + mantissa / 8.0) * 2f32.powi(exp - 7),
    };
    sign * magnitude
}

/// Rounds `x` (already clamped to ±448) to the nearest e4m3fn value, ties to even.
/// Works by scaling to the format's ulp at x's binade, which is exact in f32.
pub fn round_to_fp8_e4m3(x: f32) -> f32 {
    round_to_grid(x, -6, 3)
}

/// The e4m3fn byte of a value already on the e4m3 grid ([`round_to_fp8_e4m3`] of a value within
/// ±448): exact, by moving the f32 exponent and top three mantissa bits (subnormals, below
/// 2^-6, are multiples of 2^-9). The inverse of [`fp8_e4m3_to_f32`] on that grid.
pub fn fp8_e4m3_from_grid(v: f32) -> u8 {
    let bits = v.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let magnitude = v.abs();
    if magnitude < 0.015625 {
        return sign | (magnitude * 512.0) as u8;
    }
    let exp = ((bits >> 23) & 0xFF) - 120; // (e - 127) + 7
    sign | (exp << 3) as u8 | ((bits >> 20) & 7) as u8
}

/// fp4 e2m1 magnitudes indexed by the low three bits of a code.
pub const FP4_E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Decodes one fp4 e2m1 nibble (bit 3 is the sign; code 8 is -0.0).
pub fn fp4_e2m1_to_f32(nibble: u8) -> f32 {
    let magnitude = FP4_E2M1_VALUES[(nibble & 0x07) as usize];
    if nibble & 0x08 != 0 {
        -magnitude
    } else {
        magnitude
    }
}

/// Rounds `x` (already clamped to ±6) to the nearest e2m1 value, ties to even, sign kept.
pub fn round_to_fp4_e2m1(x: f32) -> f32 {
    round_to_grid(x, 0, 1)
}

/// Round-to-nearest-even onto a float grid with `mantissa_bits` explicit bits whose smallest
/// normal exponent is `min_exp` (below it the grid is uniform: subnormals). Sign is kept,
/// so negative values that round to zero give -0.0, as torch does.
fn round_to_grid(x: f32, min_exp: i32, mantissa_bits: i32) -> f32 {
    if x == 0.0 || !x.is_finite() {
        return x;
    }
    let binade = (x.abs().to_bits() >> 23) as i32 - 127;
    let ulp = 2f32.powi(binade.max(min_exp) - mantissa_bits);
    ((x / ulp).round_ties_even() * ulp).copysign(x)
}

/// bfloat16 rounding (nearest, ties to even) of an f32, returned as f32.
pub fn bf16_round(x: f32) -> f32 {
    half::bf16::from_f32(x).to_f32()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_encode_inverts_decode_on_the_grid() {
        for byte in 0..=255u8 {
            let v = fp8_e4m3_to_f32(byte);
            if v.is_nan() {
                continue;
            }
            assert_eq!(fp8_e4m3_from_grid(v), byte, "{v}");
        }
    }

    #[test]
    fn fp8_decode_known_values() {
        assert_eq!(fp8_e4m3_to_f32(0x00), 0.0);
        assert_eq!(fp8_e4m3_to_f32(0x7E), 448.0);
        assert_eq!(fp8_e4m3_to_f32(0xFE), -448.0);
        assert_eq!(fp8_e4m3_to_f32(0x38), 1.0);
        assert_eq!(fp8_e4m3_to_f32(0x01), 2f32.powi(-9));
        assert!(fp8_e4m3_to_f32(0x7F).is_nan());
    }

    #[test]
    fn fp8_rounding_is_the_identity_on_every_finite_code_and_never_leaves_the_grid() {
        for byte in 0u8..=255 {
            let v = fp8_e4m3_to_f32(byte);
            if v.is_nan() {
                continue;
            }
            assert_eq!(
                round_to_fp8_e4m3(v).to_bits(),
                v.to_bits(),
                "code {byte:#x}"
            );
        }
        // Midpoint between 1.0 and 1.125 ties to the even mantissa (1.0); above it goes up.
        assert_eq!(round_to_fp8_e4m3(1.0625), 1.0);
        assert_eq!(round_to_fp8_e4m3(1.1875), 1.25);
        assert_eq!(round_to_fp8_e4m3(-0.0001), -0.0);
    }

    #[test]
    fn fp4_rounding_matches_the_spec_thresholds() {
        let cases = [
            (0.25, 0.0),
            (0.26, 0.5),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.26, 1.5),
            (1.75, 2.0),
            (2.5, 2.0),
            (2.6, 3.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (5.1, 6.0),
            (-2.5, -2.0),
        ];
        for (x, want) in cases {
            assert_eq!(round_to_fp4_e2m1(x), want, "x = {x}");
        }
        for code in 0u8..16 {
            let v = fp4_e2m1_to_f32(code);
            assert_eq!(round_to_fp4_e2m1(v).to_bits(), v.to_bits());
        }
    }
}
