//! Dataset loading.

use std::io::Write;

use exactscore_client::dataset::{self, DatasetError, DatasetOptions, DatasetSpec};

#[test]
fn wikitext2_bytes_match_the_published_sha256() {
    let ds = dataset::load(&DatasetSpec::Wikitext2, &DatasetOptions::default()).unwrap();
    assert_eq!(ds.text.len(), 1_293_436);
    assert_eq!(ds.sha256, dataset::WIKITEXT2_SHA256);
    assert_eq!(ds.documents, 2891);
    assert!(!ds.text.contains('\r'));
}

#[test]
fn wikitext2_with_wrong_file_fails_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("fake.txt.gz");
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&p).unwrap(),
        flate2::Compression::fast(),
    );
    gz.write_all(b"not wikitext\r\n").unwrap();
    gz.finish().unwrap();
    let e = dataset::load(
        &DatasetSpec::Wikitext2,
        &DatasetOptions {
            field: None,
            wikitext_path: Some(p),
        },
    )
    .unwrap_err();
    assert!(matches!(e, DatasetError::Checksum { .. }), "{e}");
    assert!(e.to_string().contains("expected c5b5caea"), "{e}");
}

#[test]
fn txt_gz_is_gunzipped() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.txt.gz");
    let text = "héllo\nworld\r\n".repeat(100);
    let mut gz = flate2::write::GzEncoder::new(
        std::fs::File::create(&p).unwrap(),
        flate2::Compression::default(),
    );
    gz.write_all(text.as_bytes()).unwrap();
    gz.finish().unwrap();
    let spec = DatasetSpec::parse(p.to_str().unwrap()).unwrap();
    assert!(matches!(spec, DatasetSpec::TxtGz(_)));
    let ds = dataset::load(&spec, &DatasetOptions::default()).unwrap();
    assert_eq!(ds.text, text);
    assert_eq!(ds.sha256, dataset::sha256_hex(text.as_bytes()));
}

#[test]
fn txt_is_read_as_is() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("a.txt");
    std::fs::write(&p, "one\n\ntwo").unwrap();
    let ds = dataset::load(
        &DatasetSpec::parse(p.to_str().unwrap()).unwrap(),
        &Default::default(),
    )
    .unwrap();
    assert_eq!(ds.text, "one\n\ntwo");
}

#[test]
fn jsonl_field_selection() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.jsonl");
    std::fs::write(
        &p,
        "{\"text\": \"t1\", \"body\": \"b1\"}\n\n{\"text\": \"t2\", \"body\": \"b2\\nx\"}\n",
    )
    .unwrap();
    let spec = DatasetSpec::parse(p.to_str().unwrap()).unwrap();
    let ds = dataset::load(&spec, &DatasetOptions::default()).unwrap();
    assert_eq!(ds.text, "t1\n\nt2");
    assert_eq!(ds.documents, 2);
    let opts = DatasetOptions {
        field: Some("body".into()),
        wikitext_path: None,
    };
    assert_eq!(dataset::load(&spec, &opts).unwrap().text, "b1\n\nb2\nx");
    let opts = DatasetOptions {
        field: Some("missing".into()),
        wikitext_path: None,
    };
    let e = dataset::load(&spec, &opts).unwrap_err().to_string();
    assert!(
        e.contains(":1:") && e.contains("no field \"missing\""),
        "{e}"
    );

    std::fs::write(&p, "{\"text\": \"a\"}\n{\"text\": 3}\n").unwrap();
    let e = dataset::load(&spec, &DatasetOptions::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains(":2:") && e.contains("not a string"), "{e}");
}

#[test]
fn unknown_extension_is_refused() {
    assert!(DatasetSpec::parse("data.csv").is_err());
    assert_eq!(
        DatasetSpec::parse("wikitext2").unwrap(),
        DatasetSpec::Wikitext2
    );
}

#[test]
fn parquet_column_selection() {
    use parquet::data_type::{ByteArray, ByteArrayType, Int32Type};
    use parquet::file::properties::WriterProperties;
    use parquet::file::writer::SerializedFileWriter;
    use parquet::schema::parser::parse_message_type;
    use std::sync::Arc;

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("d.parquet");
    let schema = Arc::new(
        parse_message_type(
            "message schema { REQUIRED BYTE_ARRAY text (UTF8); REQUIRED INT32 id; \
             REQUIRED BYTE_ARRAY other (UTF8); }",
        )
        .unwrap(),
    );
    let mut w = SerializedFileWriter::new(
        std::fs::File::create(&p).unwrap(),
        schema,
        Arc::new(WriterProperties::builder().build()),
    )
    .unwrap();
    let mut rg = w.next_row_group().unwrap();
    let mut i = 0;
    while let Some(mut col) = rg.next_column().unwrap() {
        match i {
            1 => {
                col.typed::<Int32Type>()
                    .write_batch(&[1, 2, 3], None, None)
                    .unwrap();
            }
            _ => {
                let prefix = if i == 0 { "row" } else { "other" };
                let vals: Vec<ByteArray> = (0..3)
                    .map(|k| ByteArray::from(format!("{prefix} {k}").as_str()))
                    .collect();
                col.typed::<ByteArrayType>()
                    .write_batch(&vals, None, None)
                    .unwrap();
            }
        }
        col.close().unwrap();
        i += 1;
    }
    rg.close().unwrap();
    w.close().unwrap();

    let spec = DatasetSpec::parse(p.to_str().unwrap()).unwrap();
    let ds = dataset::load(&spec, &DatasetOptions::default()).unwrap();
    assert_eq!(ds.text, "row 0\n\nrow 1\n\nrow 2");
    assert_eq!(ds.documents, 3);
    let opts = DatasetOptions {
        field: Some("other".into()),
        wikitext_path: None,
    };
    assert_eq!(
        dataset::load(&spec, &opts).unwrap().text,
        "other 0\n\nother 1\n\nother 2"
    );
    let opts = DatasetOptions {
        field: Some("id".into()),
        wikitext_path: None,
    };
    let e = dataset::load(&spec, &opts).unwrap_err().to_string();
    assert!(e.contains("not a string"), "{e}");
    let opts = DatasetOptions {
        field: Some("nope".into()),
        wikitext_path: None,
    };
    let e = dataset::load(&spec, &opts).unwrap_err().to_string();
    assert!(e.contains("columns: text, id, other"), "{e}");
}
