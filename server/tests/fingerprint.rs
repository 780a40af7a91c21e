//! Issue 37, item 3: the checkpoint fingerprint of `/info` (`checkpoint::fingerprint`) sees a
//! changed weight, config or tokenizer; the reference-tokenizer check compares the tokenizers'
//! whole content, merges included.

mod common;

use exactscore_server::checkpoint::fingerprint;
use exactscore_server::tokenizer::TextTokenizer;

const FIXTURE: &str = "llama-w4a16-g128";

fn copy_tokenizer(to: &std::path::Path) {
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        let from = common::fixtures().join(FIXTURE).join(f);
        if from.exists() {
            std::fs::copy(from, to.join(f)).unwrap();
        }
    }
}

#[test]
fn the_fingerprint_sees_weights_config_and_tokenizer() {
    let original = fingerprint(&common::fixtures().join(FIXTURE)).unwrap();
    assert_eq!(original.len(), 64);
    assert!(original.bytes().all(|b| b.is_ascii_hexdigit()));
    assert_eq!(
        original,
        fingerprint(&common::fixtures().join(FIXTURE)).unwrap()
    );
    // The same tensors rewritten: the same fingerprint (the serializer writes the same bytes).
    let same = common::edited_copy(FIXTURE, 1, |_| {}, |_| {});
    copy_tokenizer(same.path());
    let config = common::fixtures().join(FIXTURE).join("config.json");
    std::fs::copy(&config, same.path().join("config.json")).unwrap();
    let same_print = fingerprint(same.path()).unwrap();
    // One weight byte changed, same header.
    let weight = common::edited_copy(
        FIXTURE,
        1,
        |t| {
            let (_, _, bytes) = t.get_mut("model.norm.weight").unwrap();
            bytes[1] ^= 0x01;
        },
        |_| {},
    );
    copy_tokenizer(weight.path());
    std::fs::copy(&config, weight.path().join("config.json")).unwrap();
    assert_ne!(fingerprint(weight.path()).unwrap(), same_print, "a weight");
    // The config (rewritten without formatting: other bytes).
    let config_edit = common::edited_copy(FIXTURE, 1, |_| {}, |_| {});
    copy_tokenizer(config_edit.path());
    assert_ne!(
        fingerprint(config_edit.path()).unwrap(),
        same_print,
        "config.json"
    );
    // A tokenizer merge.
    let tokenizer = common::edited_copy(FIXTURE, 1, |_| {}, |_| {});
    copy_tokenizer(tokenizer.path());
    std::fs::copy(&config, tokenizer.path().join("config.json")).unwrap();
    let path = tokenizer.path().join("tokenizer.json");
    let text = std::fs::read_to_string(&path).unwrap();
    std::fs::write(&path, format!("{text} ")).unwrap();
    assert_ne!(
        fingerprint(tokenizer.path()).unwrap(),
        same_print,
        "tokenizer.json"
    );
    // Sharded: the same tensors in two files are another checkpoint layout, seen too.
    let sharded = common::edited_copy(FIXTURE, 2, |_| {}, |_| {});
    assert!(fingerprint(sharded.path()).is_ok());
}

/// Two tokenizers with the same vocabulary and special tokens but other merges map text to
/// other ids: the reference check refuses them, naming the section.
#[test]
fn tokenizers_that_differ_only_in_merges_differ() {
    let dir = common::fixtures().join(FIXTURE);
    let ours = TextTokenizer::load(&dir).unwrap();
    assert_eq!(ours.difference(&TextTokenizer::load(&dir).unwrap()), None);
    let other = tempfile::tempdir().unwrap();
    copy_tokenizer(other.path());
    let path = other.path().join("tokenizer.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let merges = json["model"]["merges"]
        .as_array_mut()
        .expect("a BPE with merges");
    assert!(merges.len() > 2);
    merges.swap(0, 1);
    std::fs::write(&path, json.to_string()).unwrap();
    let theirs = TextTokenizer::load(other.path()).unwrap();
    let difference = ours.difference(&theirs).expect("merges differ");
    assert!(difference.contains("`model.merges`"), "{difference}");
    // Formatting alone is no difference.
    let pretty = tempfile::tempdir().unwrap();
    copy_tokenizer(pretty.path());
    let path = pretty.path().join("tokenizer.json");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    std::fs::write(&path, serde_json::to_string_pretty(&json).unwrap()).unwrap();
    assert_eq!(
        ours.difference(&TextTokenizer::load(pretty.path()).unwrap()),
        None
    );
}
