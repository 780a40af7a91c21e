//! Property tests of the checkpoint loader: the tiny fixture with a mutated `config.json` or a
//! mutated safetensors file (header length, offsets that lie, huge or odd shapes, wrong dtypes,
//! random header bytes, truncation, extra entries, a NaN or an infinity in any float tensor). Loading must return an error that names
//! the file, the tensor or the config field (or succeed when the mutation is harmless), never
//! panic, and never ask for an allocation larger than [`MAX_ALLOCATION`]: a counting global
//! allocator refuses (and records) anything bigger, which aborts the test.
//!
//! The only `unsafe` of the test suite is that allocator (a pass-through to `System`).
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use candle_core::{DType, Device};
use exactscore_server::model::{AttentionKernel, Model, ModelOptions};
use exactscore_server::quant::{ActivationQuantMode, LinearOptions};
use proptest::prelude::*;
use serde_json::{json, Value};

/// The fixture's weights are 2.6 MB; the largest legitimate allocation (f32 embedding, RoPE
/// tables) is a few MB. 256 MiB would only be asked for because of a declared size.
const MAX_ALLOCATION: usize = 256 << 20;

struct Counting;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        if layout.size() > MAX_ALLOCATION {
            return std::ptr::null_mut(); // handle_alloc_error: the test process aborts
        }
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        if layout.size() > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        if new_size > MAX_ALLOCATION {
            return std::ptr::null_mut();
        }
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// The properties share the allocation high-water mark: one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn fixture() -> std::path::PathBuf {
    fixture_dir("llama-w4a16-g128")
}

fn fixture_dir(variant: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(variant)
}

/// The fixtures of the other checkpoint formats (issue 35), whose config mutations are fuzzed
/// too: their quantization configs are read by other code.
const OTHER_FORMATS: [&str; 7] = [
    "gpt_oss-mxfp4",
    "llama-gptq-int4-g128",
    "llama-gptq-v2-int3-actorder-asym",
    "llama-mxfp4a16",
    "llama-w4a16-actorder-g64",
    "llama-awq-int4-g64",
    "llama-fp8-block",
];

fn options() -> ModelOptions {
    ModelOptions {
        linear: LinearOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            activation_quant: ActivationQuantMode::Emulate,
            kv_cache: Default::default(),
            fp8_matmul: Default::default(),
            fused_fp8_scales: Default::default(),
        },
        max_seq_len: 512,
        attention: AttentionKernel::Auto,
    }
}

/// Loads a checkpoint made of `config` and `weights`; the error text, or `None` when it loads.
fn load(config: &[u8], weights: &[u8]) -> Option<String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), config).unwrap();
    std::fs::write(dir.path().join("model.safetensors"), weights).unwrap();
    LARGEST.store(0, Ordering::Relaxed);
    let result = Model::load(dir.path(), &options());
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(largest <= MAX_ALLOCATION, "allocation of {largest} bytes");
    result.err().map(|e| e.to_string())
}

struct Fixture {
    config: Value,
    header: serde_json::Map<String, Value>,
    data: Vec<u8>,
}

fn fixture_parts() -> Fixture {
    fixture_parts_of(&fixture())
}

fn fixture_parts_of(dir: &std::path::Path) -> Fixture {
    let config = serde_json::from_slice(&std::fs::read(dir.join("config.json")).unwrap()).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    Fixture {
        config,
        header,
        data: bytes[8 + n..].to_vec(),
    }
}

fn safetensors(header: &serde_json::Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).unwrap();
    [&(h.len() as u64).to_le_bytes()[..], &h, data].concat()
}

fn tensor_names(header: &serde_json::Map<String, Value>) -> Vec<String> {
    header
        .keys()
        .filter(|k| *k != "__metadata__")
        .cloned()
        .collect()
}

/// An error must say where: the file, a tensor, or a config field.
fn assert_named(err: &str, what: &str) {
    let named = err.contains("model.safetensors")
        || err.contains("config.json")
        || err.contains("tensor `")
        || err.contains("config field `")
        || err.contains("quantization field `")
        || err.contains("layer `");
    assert!(named, "{what}: error names nothing: {err}");
}

fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        prop::sample::select(vec![
            0i64,
            1,
            -1,
            2,
            3,
            7,
            64,
            127,
            4096,
            1 << 31,
            1 << 40,
            1 << 62,
            i64::MAX,
            i64::MIN,
        ])
        .prop_map(Value::from),
        Just(json!(u64::MAX)),
        prop::sample::select(vec![0.5f64, -0.0, 1e-300, 1e300, -1e300]).prop_map(Value::from),
        "[a-z_\\-]{0,12}".prop_map(Value::from),
        Just(json!([])),
        Just(json!({})),
        Just(json!([1, "x", null])),
        Just(json!({"rope_type": "llama3"})),
        Just(json!({"rope_type": "yarn", "factor": null, "beta_fast": 0})),
        Just(json!({"rope_type": "dynamic", "factor": 1e300})),
    ]
}

/// Paths of every member of the config (nested objects included).
fn paths(v: &Value, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
    if let Some(o) = v.as_object() {
        for (k, child) in o {
            prefix.push(k.clone());
            out.push(prefix.clone());
            paths(child, prefix, out);
            prefix.pop();
        }
    }
}

fn set_path(v: &mut Value, path: &[String], new: Option<Value>) {
    let (last, parents) = path.split_last().unwrap();
    let mut at = v;
    for p in parents {
        at = &mut at[p.as_str()];
    }
    if let Some(o) = at.as_object_mut() {
        match new {
            Some(n) => drop(o.insert(last.clone(), n)),
            None => drop(o.remove(last)),
        }
    }
}

/// A header mutation.
#[derive(Debug, Clone)]
enum HeaderEdit {
    Offsets {
        tensor: usize,
        start: u64,
        end: u64,
    },
    ShiftOffsets {
        tensor: usize,
        by: i64,
    },
    Shape {
        tensor: usize,
        shape: Vec<u64>,
    },
    Dtype {
        tensor: usize,
        dtype: String,
    },
    Remove {
        tensor: usize,
    },
    Extra {
        dtype: String,
        shape: Vec<u64>,
        start: u64,
        end: u64,
    },
    Field {
        tensor: usize,
        value: Value,
    },
}

fn header_edit() -> impl Strategy<Value = HeaderEdit> {
    let big = prop::sample::select(vec![
        0u64,
        1,
        2,
        255,
        4096,
        1 << 20,
        1 << 31,
        1 << 32,
        1 << 40,
        1 << 62,
        u64::MAX / 2,
        u64::MAX,
    ]);
    let dtype = prop::sample::select(vec![
        "F32", "F16", "BF16", "I8", "U8", "I32", "I64", "F8_E4M3", "F64", "BOOL", "Q4", "",
    ])
    .prop_map(String::from);
    let shape = prop::collection::vec(big.clone(), 0..5);
    prop_oneof![
        (any::<usize>(), big.clone(), big.clone())
            .prop_map(|(tensor, start, end)| HeaderEdit::Offsets { tensor, start, end }),
        (any::<usize>(), -4096i64..4096)
            .prop_map(|(tensor, by)| HeaderEdit::ShiftOffsets { tensor, by }),
        (any::<usize>(), shape.clone())
            .prop_map(|(tensor, shape)| HeaderEdit::Shape { tensor, shape }),
        (any::<usize>(), dtype.clone())
            .prop_map(|(tensor, dtype)| HeaderEdit::Dtype { tensor, dtype }),
        any::<usize>().prop_map(|tensor| HeaderEdit::Remove { tensor }),
        (dtype, shape, big.clone(), big).prop_map(|(dtype, shape, start, end)| HeaderEdit::Extra {
            dtype,
            shape,
            start,
            end
        }),
        (any::<usize>(), any_json())
            .prop_map(|(tensor, value)| HeaderEdit::Field { tensor, value }),
    ]
}

fn apply(edit: &HeaderEdit, header: &mut serde_json::Map<String, Value>) {
    let names = tensor_names(header);
    let pick = |i: usize| names[i % names.len()].clone();
    match edit {
        HeaderEdit::Offsets { tensor, start, end } => {
            header[&pick(*tensor)]["data_offsets"] = json!([start, end]);
        }
        HeaderEdit::ShiftOffsets { tensor, by } => {
            let t = &mut header[&pick(*tensor)];
            // (An earlier edit may have made the offsets something else: then leave them.)
            if let Ok([a, b]) = serde_json::from_value::<[i64; 2]>(t["data_offsets"].clone()) {
                t["data_offsets"] = json!([a.saturating_add(*by), b.saturating_add(*by)]);
            }
        }
        HeaderEdit::Shape { tensor, shape } => header[&pick(*tensor)]["shape"] = json!(shape),
        HeaderEdit::Dtype { tensor, dtype } => header[&pick(*tensor)]["dtype"] = json!(dtype),
        HeaderEdit::Remove { tensor } => drop(header.remove(&pick(*tensor))),
        HeaderEdit::Extra {
            dtype,
            shape,
            start,
            end,
        } => {
            header.insert(
                "model.layers.0.extra.weight".into(),
                json!({"dtype": dtype, "shape": shape, "data_offsets": [start, end]}),
            );
        }
        HeaderEdit::Field { tensor, value } => {
            let key = ["dtype", "shape", "data_offsets"][*tensor % 3];
            header[&pick(*tensor)][key] = value.clone();
        }
    }
}

/// `FUZZ_TRACE=1`: print each case before it runs (an over-large allocation aborts the
/// process before proptest can report it).
fn trace(what: &str) {
    if std::env::var_os("FUZZ_TRACE").is_some() {
        eprintln!("case: {what}");
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(96)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// A member of config.json (nested ones included) set to a value of any type, or removed.
    #[test]
    fn mutated_config_is_refused_by_name(pick in any::<usize>(), value in prop::option::of(any_json())) {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let f = fixture_parts();
        let mut all = Vec::new();
        paths(&f.config, &mut Vec::new(), &mut all);
        let path = &all[pick % all.len()];
        let mut config = f.config.clone();
        set_path(&mut config, path, value.clone());
        let what = format!("config {} = {value:?}", path.join("."));
        trace(&what);
        if let Some(err) = load(config.to_string().as_bytes(), &safetensors(&f.header, &f.data)) {
            assert_named(&err, &what);
        }
    }

    /// The same of the other formats' fixtures (their `quantization_config` included).
    #[test]
    fn mutated_config_of_other_formats_is_refused_by_name(
        variant in prop::sample::select(OTHER_FORMATS.to_vec()),
        pick in any::<usize>(),
        value in prop::option::of(any_json()),
    ) {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let f = fixture_parts_of(&fixture_dir(variant));
        let mut all = Vec::new();
        paths(&f.config, &mut Vec::new(), &mut all);
        let path = &all[pick % all.len()];
        let mut config = f.config.clone();
        set_path(&mut config, path, value.clone());
        let what = format!("{variant}: config {} = {value:?}", path.join("."));
        trace(&what);
        if let Some(err) = load(config.to_string().as_bytes(), &safetensors(&f.header, &f.data)) {
            assert_named(&err, &what);
        }
    }

    /// One or two edits of the safetensors header.
    #[test]
    fn mutated_safetensors_header_is_refused_by_name(edits in prop::collection::vec(header_edit(), 1..3)) {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let f = fixture_parts();
        let mut header = f.header.clone();
        for e in &edits {
            apply(e, &mut header);
        }
        trace(&format!("{edits:?}"));
        if let Some(err) = load(f.config.to_string().as_bytes(), &safetensors(&header, &f.data)) {
            assert_named(&err, &format!("{edits:?}"));
        }
    }

    /// Random bytes overwritten in the first part of the file (length prefix and header), or
    /// the file cut anywhere.
    #[test]
    fn corrupted_or_truncated_file_is_refused_by_name(
        at in any::<prop::sample::Index>(),
        bytes in prop::collection::vec(any::<u8>(), 1..9),
        truncate in any::<bool>(),
    ) {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let f = fixture_parts();
        let mut file = safetensors(&f.header, &f.data);
        let header_end = 8 + serde_json::to_vec(&f.header).unwrap().len();
        if truncate {
            file.truncate(at.index(file.len()));
        } else {
            let start = at.index(header_end);
            for (i, b) in bytes.iter().enumerate() {
                if let Some(slot) = file.get_mut(start + i) {
                    *slot = *b;
                }
            }
        }
        if let Some(err) = load(f.config.to_string().as_bytes(), &file) {
            assert_named(&err, &format!("truncate={truncate} at {at:?}"));
        } else {
            prop_assert!(!truncate, "a truncated file loaded");
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: cases(), failure_persistence: None, ..ProptestConfig::default() })]

    /// One element of any float tensor (norms, embeddings, lm_head, scales: bf16, f32, fp8)
    /// set to NaN, inf or -inf: refused naming that tensor (each loaded before and served
    /// `null` logprobs).
    #[test]
    fn a_non_finite_float_anywhere_is_refused_naming_its_tensor(
        pick in any::<prop::sample::Index>(),
        element in any::<prop::sample::Index>(),
        value in prop::sample::select(vec![f32::NAN, f32::INFINITY, f32::NEG_INFINITY]),
    ) {
        let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
        let f = fixture_parts();
        let floats: Vec<String> = tensor_names(&f.header)
            .into_iter()
            .filter(|n| ["F32", "F16", "BF16"].contains(&f.header[n]["dtype"].as_str().unwrap()))
            .collect();
        let name = pick.get(&floats);
        let dtype = f.header[name]["dtype"].as_str().unwrap();
        let [start, end]: [usize; 2] =
            serde_json::from_value(f.header[name]["data_offsets"].clone()).unwrap();
        let special = match dtype {
            "F32" => value.to_le_bytes().to_vec(),
            "F16" => half::f16::from_f32(value).to_le_bytes().to_vec(),
            _ => half::bf16::from_f32(value).to_le_bytes().to_vec(),
        };
        let at = start + element.index((end - start) / special.len()) * special.len();
        let mut data = f.data.clone();
        data[at..at + special.len()].copy_from_slice(&special);
        trace(&format!("{name}[{}] = {value}", (at - start) / special.len()));
        let err = load(f.config.to_string().as_bytes(), &safetensors(&f.header, &data));
        let err = err.unwrap_or_else(|| panic!("{name} with {value} loaded"));
        prop_assert!(err.contains(&format!("tensor `{name}`")) && err.contains("finite"), "{err}");
    }
}

/// Specific lies, each of which must fail with the file's name.
#[test]
fn lying_headers_are_refused_with_the_file_name() {
    let _one = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let f = fixture_parts();
    let config = f.config.to_string();
    let good = safetensors(&f.header, &f.data);
    assert!(
        load(config.as_bytes(), &good).is_none(),
        "the unmodified copy loads"
    );
    let name = tensor_names(&f.header)[0].clone();
    let mut cases: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut huge_len = good.clone();
    huge_len[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    cases.push(("header length u64::MAX", huge_len));
    let mut past_end = good.clone();
    past_end[..8].copy_from_slice(&((good.len() as u64) - 7).to_le_bytes());
    cases.push(("header length past the end", past_end));
    cases.push(("8 bytes", good[..8].to_vec()));
    cases.push(("empty file", Vec::new()));
    for (label, offsets) in [
        ("offsets past the end", json!([0, 1u64 << 40])),
        ("reversed offsets", json!([16, 0])),
        ("u64::MAX offsets", json!([u64::MAX - 1, u64::MAX])),
    ] {
        let mut h = f.header.clone();
        h[&name]["data_offsets"] = offsets;
        cases.push((label, safetensors(&h, &f.data)));
    }
    let mut h = f.header.clone();
    h[&name]["shape"] = json!([1u64 << 32, 1u64 << 32, 1u64 << 32]);
    cases.push(("shape overflowing u64", safetensors(&h, &f.data)));
    for (label, file) in cases {
        let err = load(config.as_bytes(), &file).unwrap_or_else(|| panic!("{label}: loaded"));
        assert!(err.contains("model.safetensors"), "{label}: {err}");
    }
}
