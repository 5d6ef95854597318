//! Rows of verl's dataset layout, written as verl's `examples/data_preprocess` scripts leave
//! them: JSON objects, or parquet as pyarrow writes a pandas frame of those columns.

use std::path::Path;
use std::sync::Arc;

use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::writer::{SerializedFileWriter, SerializedRowGroupWriter};
use parquet::schema::parser::parse_message_type;
use serde_json::{json, Value};

/// One row: `prompt` as chat messages; `truth: None` leaves `reward_model` null (a bad row).
#[derive(Debug, Clone)]
pub(crate) struct VerlRow {
    pub source: String,
    /// (role, content)
    pub messages: Vec<(String, String)>,
    pub truth: Option<String>,
    pub index: i64,
}

impl VerlRow {
    pub(crate) fn new(
        source: &str,
        messages: &[(&str, &str)],
        truth: Option<&str>,
        index: i64,
    ) -> Self {
        Self {
            source: source.into(),
            messages: messages
                .iter()
                .map(|(role, content)| (role.to_string(), content.to_string()))
                .collect(),
            truth: truth.map(str::to_string),
            index,
        }
    }

    /// The row as the JSON object verl's JSONL rows are.
    pub(crate) fn to_json(&self) -> Value {
        json!({
            "data_source": self.source,
            "prompt": self.messages.iter()
                .map(|(role, content)| json!({ "role": role, "content": content }))
                .collect::<Vec<_>>(),
            "reward_model": self.truth.as_ref().map(|t| json!({ "ground_truth": t, "style": "rule" })),
            "extra_info": { "index": self.index, "split": "train" },
        })
    }
}

/// Writes `rows` as pyarrow does from a pandas frame of verl's columns (`prompt` a list of
/// structs, `reward_model` and `extra_info` structs), with `props` (compression, dictionary
/// pages). Written leaf by leaf with Dremel definition/repetition levels, so tests need no
/// arrow.
pub(crate) fn write_parquet(path: &Path, rows: &[VerlRow], props: WriterProperties) {
    let schema = parse_message_type(
        "message schema {
            OPTIONAL BYTE_ARRAY data_source (UTF8);
            OPTIONAL group prompt (LIST) {
                REPEATED group list {
                    OPTIONAL group element {
                        OPTIONAL BYTE_ARRAY content (UTF8);
                        OPTIONAL BYTE_ARRAY role (UTF8);
                    }
                }
            }
            OPTIONAL group reward_model {
                OPTIONAL BYTE_ARRAY ground_truth (UTF8);
                OPTIONAL BYTE_ARRAY style (UTF8);
            }
            OPTIONAL group extra_info {
                OPTIONAL INT64 index;
                OPTIONAL BYTE_ARRAY split (UTF8);
            }
        }",
    )
    .unwrap();
    let file = std::fs::File::create(path).unwrap();
    let mut writer = SerializedFileWriter::new(file, Arc::new(schema), Arc::new(props)).unwrap();
    let mut group = writer.next_row_group().unwrap();
    let bytes = |s: &str| ByteArray::from(s);

    // data_source: an optional leaf at the top (max definition level 1).
    strings(
        &mut group,
        rows.iter().map(|r| bytes(&r.source)).collect(),
        vec![1; rows.len()],
        None,
    );

    // prompt.list.element.{content, role}: max definition level 4, max repetition level 1.
    for content in [true, false] {
        let (mut values, mut defs, mut reps) = (Vec::new(), Vec::new(), Vec::new());
        for r in rows {
            for (j, (role, text)) in r.messages.iter().enumerate() {
                values.push(bytes(if content { text } else { role }));
                defs.push(4);
                reps.push(if j == 0 { 0 } else { 1 });
            }
        }
        strings(&mut group, values, defs, Some(reps));
    }

    // reward_model.{ground_truth, style}: level 2 when present, 0 when the struct is null.
    let defs: Vec<i16> = rows
        .iter()
        .map(|r| if r.truth.is_some() { 2 } else { 0 })
        .collect();
    for style in [false, true] {
        let values = rows
            .iter()
            .filter_map(|r| r.truth.as_deref())
            .map(|t| bytes(if style { "rule" } else { t }))
            .collect();
        strings(&mut group, values, defs.clone(), None);
    }

    // extra_info.{index, split}.
    let mut col = group.next_column().unwrap().unwrap();
    let values: Vec<i64> = rows.iter().map(|r| r.index).collect();
    col.typed::<Int64Type>()
        .write_batch(&values, Some(&vec![2; rows.len()]), None)
        .unwrap();
    col.close().unwrap();
    strings(
        &mut group,
        rows.iter().map(|_| bytes("train")).collect(),
        vec![2; rows.len()],
        None,
    );

    group.close().unwrap();
    writer.close().unwrap();
}

/// The next column of `group`, a string leaf, with its levels.
fn strings(
    group: &mut SerializedRowGroupWriter<'_, std::fs::File>,
    values: Vec<ByteArray>,
    defs: Vec<i16>,
    reps: Option<Vec<i16>>,
) {
    let mut col = group.next_column().unwrap().unwrap();
    col.typed::<ByteArrayType>()
        .write_batch(&values, Some(&defs), reps.as_deref())
        .unwrap();
    col.close().unwrap();
}
