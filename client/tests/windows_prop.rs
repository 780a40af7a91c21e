//! Property tests of the window arithmetic.

use exactscore_client::windows::{windows, Method, WindowParams};
use proptest::prelude::*;

fn params(method: Method, ctx: usize, stride: usize) -> WindowParams {
    WindowParams {
        method,
        ctx,
        stride,
        prefix_token: Some(u32::MAX),
        max_windows: None,
    }
}

/// How many times each text token is predicted.
fn coverage(n: usize, p: &WindowParams) -> Vec<usize> {
    let mut c = vec![0; n];
    for w in windows(n, p).unwrap() {
        for i in w.predicted() {
            c[i] += 1;
        }
    }
    c
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn disjoint_scores_every_token_after_the_first_once(n in 0usize..400, ctx in 2usize..70) {
        let p = params(Method::Disjoint, ctx, 1);
        let ws = windows(n, &p).unwrap();
        let c = coverage(n, &p);
        if n > 0 {
            prop_assert_eq!(c[0], 0);
        }
        prop_assert!(c.iter().skip(1).all(|&k| k == 1), "{:?}", c);
        for (j, w) in ws.iter().enumerate() {
            prop_assert_eq!(w.index, j);
            prop_assert!(w.len() <= ctx && w.len() >= 2);
            prop_assert_eq!(w.prefix, None);
            prop_assert_eq!(w.scored.clone(), 1..w.len());
            if j > 0 {
                // Window j starts with the last token of window j-1 (context only).
                prop_assert_eq!(w.range.start, ws[j - 1].range.end - 1);
                prop_assert_eq!(ws[j - 1].len(), ctx);
            }
        }
    }

    #[test]
    fn exl3_windows_are_strided_full_windows(n in 0usize..400, ctx in 2usize..70, stride in 1usize..80) {
        let ws = windows(n, &params(Method::Exl3, ctx, stride)).unwrap();
        let expected = if n >= ctx { (n - ctx) / stride + 1 } else { 0 };
        prop_assert_eq!(ws.len(), expected);
        for (k, w) in ws.iter().enumerate() {
            prop_assert_eq!(w.range.clone(), k * stride..k * stride + ctx);
            prop_assert_eq!(w.scored.clone(), 1..ctx);
            prop_assert_eq!(w.prefix, None);
        }
        // Overlaps are counted once per window.
        let total: usize = ws.iter().map(|w| w.num_scored()).sum();
        prop_assert_eq!(total, expected * (ctx - 1));
    }

    #[test]
    fn rolling_predicts_every_token_once(n in 0usize..400, ctx in 2usize..70) {
        let p = params(Method::Rolling, ctx, 0);
        let tokens: Vec<u32> = (0..n as u32).collect();
        let ws = windows(n, &p).unwrap();
        let c = coverage(n, &p);
        prop_assert!(c.iter().all(|&k| k == 1), "{:?}", c);
        let m = ctx - 1;
        for (j, w) in ws.iter().enumerate() {
            prop_assert!(w.len() <= ctx);
            let seq = w.sequence(&tokens);
            // Position p of the request is the token it claims to be.
            for (pos, &t) in seq.iter().enumerate() {
                match w.token_index(pos) {
                    Some(i) => prop_assert_eq!(t, tokens[i]),
                    None => prop_assert_eq!(t, u32::MAX),
                }
            }
            // Scored positions run to the end of the request.
            prop_assert_eq!(w.scored.end, w.len());
            if j == 0 {
                prop_assert_eq!(w.prefix, Some(u32::MAX));
                prop_assert_eq!(w.range.clone(), 0..m.min(n));
                prop_assert_eq!(w.scored.clone(), 1..w.len());
            } else {
                prop_assert_eq!(w.prefix, None);
                prop_assert_eq!(w.len(), ctx);
                let context = w.len() - w.num_scored();
                if w.num_scored() == m {
                    // Full window: exactly one token of context, the previous window's last one.
                    prop_assert_eq!(context, 1);
                    prop_assert_eq!(w.range.start, ws[j - 1].range.end - 1);
                } else {
                    // The last, short window is filled with left context up to ctx.
                    prop_assert_eq!(j, ws.len() - 1);
                    prop_assert_eq!(context, ctx - w.num_scored());
                }
            }
        }
    }

    #[test]
    fn max_windows_keeps_a_prefix(n in 0usize..300, ctx in 2usize..40, stride in 1usize..40,
                                  k in 0usize..20, m in 0usize..3) {
        let method = [Method::Exl3, Method::Disjoint, Method::Rolling][m];
        let mut p = params(method, ctx, stride);
        let all = windows(n, &p).unwrap();
        p.max_windows = Some(k);
        let some = windows(n, &p).unwrap();
        prop_assert_eq!(&some[..], &all[..k.min(all.len())]);
    }
}
