//! Fuzzing of the readers of bytes from other processes and from disk in verl-core: a
//! `DataProto` from its wire buffer ([`DataProto::from_wire`]) or its saved directory
//! ([`DataProto::load`]), and the driver ↔ worker frames ([`WireReader::recv`]).
//!
//! Each property mutates a valid encoding (its manifest, its tensors' dtypes, shapes and
//! offsets, its bytes; a frame's lengths and header) or uses random bytes, and asserts that
//! the reader returns `Ok` or an error with a message, never a panic.
//!
//! [`WireReader::recv`]: verl_core::wire::WireReader::recv

mod fuzz_support;
use fuzz_support::*;

use std::io::Write;
use std::net::{Shutdown, TcpListener, TcpStream};
use std::time::Duration;

use burn::tensor::{Int, Tensor, TensorData};
use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};
use verl_core::backend::CpuBackend as B;
use verl_core::wire::{split, MAX_FRAME_BYTES};
use verl_core::DataProto;

/// A batch of `rows` rows: an int `[rows, width]` column, a float `[rows]` column, a
/// non-tensor column and `meta_info`.
fn batch(rows: usize, width: usize) -> DataProto<B> {
    let device = Default::default();
    let mut d = DataProto::<B>::new();
    let ids: Vec<i64> = (0..rows * width).map(|i| i as i64).collect();
    d.insert_int(
        "input_ids",
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [rows, width]), &device),
    )
    .unwrap();
    let scores: Vec<f32> = (0..rows).map(|i| i as f32 * 0.5).collect();
    d.insert_float(
        "scores",
        Tensor::<B, 1>::from_data(TensorData::new(scores, [rows]), &device),
    )
    .unwrap();
    d.insert_non_tensor("uid", (0..rows).map(|i| json!(format!("u{i}"))).collect())
        .unwrap();
    d.meta_info.insert("global_steps".into(), json!(3));
    d
}

/// The manifest's keys (`verl.data_proto` in the wire header, `data_proto.json` on disk).
const MANIFEST_FIELDS: &[&str] = &[
    "version",
    "columns",
    "columns.input_ids",
    "columns.scores",
    "columns.extra",
    "non_tensor",
    "non_tensor.uid",
    "non_tensor.uid.0",
    "meta_info",
];

const TENSOR_FIELDS: &[&str] = &["dtype", "shape", "data_offsets"];

/// A change to an encoded batch.
#[derive(Debug, Clone)]
enum BatchEdit {
    /// An edit of the manifest.
    Manifest(JsonEdit),
    /// Sets (or, with `None`, removes) `dtype`, `shape` or `data_offsets` of one tensor.
    Tensor(Index, &'static str, Option<Value>),
    /// A byte-level change to the tensors' buffer.
    Bytes(ByteEdit),
}

fn batch_edit() -> impl Strategy<Value = BatchEdit> {
    prop_oneof![
        2 => json_edit(MANIFEST_FIELDS).prop_map(BatchEdit::Manifest),
        2 => (
            any::<Index>(),
            prop::sample::select(TENSOR_FIELDS),
            prop_oneof![sizes().prop_map(Some), Just(None)],
        )
            .prop_map(|(i, f, v)| BatchEdit::Tensor(i, f, v)),
        2 => byte_edit().prop_map(BatchEdit::Bytes),
    ]
}

/// Applies the [`BatchEdit::Tensor`] edits to a safetensors header.
fn edit_tensors(header: &mut Value, edits: &[BatchEdit]) {
    let names: Vec<String> = header
        .as_object()
        .map(|m| m.keys().filter(|k| *k != "__metadata__").cloned().collect())
        .unwrap_or_default();
    for e in edits {
        if let (BatchEdit::Tensor(i, field, value), false) = (e, names.is_empty()) {
            let path = vec![names[i.index(names.len())].clone(), field.to_string()];
            match value {
                Some(v) => apply_json(header, &JsonEdit::Set(path, v.clone())),
                None => apply_json(header, &JsonEdit::Remove(path)),
            }
        }
    }
}

/// Applies the [`BatchEdit::Bytes`] edits to a file.
fn edit_bytes(bytes: Vec<u8>, edits: &[BatchEdit]) -> Vec<u8> {
    edits.iter().fold(bytes, |b, e| match e {
        BatchEdit::Bytes(edit) => apply_bytes(b, edit),
        _ => b,
    })
}

/// Applies the [`BatchEdit::Manifest`] edits to a manifest.
fn edit_manifest(manifest: &mut Value, edits: &[BatchEdit]) {
    for e in edits {
        if let BatchEdit::Manifest(edit) = e {
            apply_json(manifest, edit);
        }
    }
}

/// A wire buffer of a generated batch with `edits`, or random bytes.
fn wire_buffers() -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![
        8 => (1usize..4, 1usize..4, prop::collection::vec(batch_edit(), 0..3)).prop_map(
            |(rows, width, edits)| {
                let (mut header, data) = split_st(&batch(rows, width).to_wire().unwrap());
                let text = header["__metadata__"]["verl.data_proto"].as_str().unwrap_or("{}");
                let mut manifest: Value = serde_json::from_str(text).unwrap_or(Value::Null);
                edit_manifest(&mut manifest, &edits);
                header["__metadata__"]["verl.data_proto"] = Value::String(manifest.to_string());
                edit_tensors(&mut header, &edits);
                edit_bytes(encode_st(&header, &data), &edits)
            }
        ),
        1 => prop::collection::vec(any::<u8>(), 0..256),
    ]
}

/// A tensor column whose batch dimension (or another) is 0 and whose other dimensions are
/// huge, as a wire buffer: safetensors accepts it (no bytes), the manifest names it.
fn zero_length_column(shape: &[u64], kind: &str) -> Vec<u8> {
    let manifest = json!({
        "version": 1, "columns": { "x": kind }, "non_tensor": {}, "meta_info": {},
    });
    let dtype = match kind {
        "float" => "F32",
        "int" => "I64",
        _ => "U8",
    };
    let header = json!({
        "__metadata__": { "verl.data_proto": manifest.to_string() },
        "x": { "dtype": dtype, "shape": shape, "data_offsets": [0, 0] },
    });
    encode_st(&header, &[])
}

/// A frame's 8-byte length as sent.
#[derive(Debug, Clone)]
enum FrameLength {
    /// The frame's real length.
    Exact,
    /// Less than the frame holds (the rest is left unread).
    Shorter(Index),
    /// More than the frame holds: the connection ends first.
    Longer(u8),
    /// Beyond [`MAX_FRAME_BYTES`]: refused before anything is allocated.
    Huge(u64),
}

/// The JSON headers the driver and workers send.
fn frame_headers() -> Vec<Value> {
    vec![
        json!({ "kind": "hello", "rank": 3, "pid": 42 }),
        json!({ "kind": "call", "id": 7, "method": "generate_sequences" }),
        json!({ "kind": "reply", "id": 7, "error": null }),
        json!({
            "kind": "reply", "id": 7, "error": { "rank": 1, "method": "m", "message": "boom" },
        }),
        json!({ "kind": "abort", "reason": "rank 1 failed" }),
        json!({ "kind": "shutdown" }),
    ]
}

const FRAME_FIELDS: &[&str] = &[
    "kind",
    "rank",
    "pid",
    "id",
    "method",
    "error",
    "error.rank",
    "error.message",
    "reason",
];

/// One frame as a peer sends it: `[length: u64 LE][header length: u32 LE][header][payload]`,
/// with its parts mutated.
#[derive(Debug, Clone)]
struct Frame {
    header: Vec<u8>,
    /// Replaces the header's real length.
    header_length: Option<u32>,
    payload: Vec<u8>,
    length: FrameLength,
}

fn frames() -> impl Strategy<Value = Frame> {
    let header = prop_oneof![
        4 => (
            prop::sample::select(frame_headers()),
            prop::collection::vec(json_edit(FRAME_FIELDS), 0..2),
            prop::collection::vec(byte_edit(), 0..2),
        )
            .prop_map(|(h, j, b)| mutated(h, &j, &b)),
        1 => prop::collection::vec(any::<u8>(), 0..32),
    ];
    let length = prop_oneof![
        4 => Just(FrameLength::Exact),
        1 => any::<Index>().prop_map(FrameLength::Shorter),
        1 => (1u8..=64).prop_map(FrameLength::Longer),
        1 => (MAX_FRAME_BYTES as u64 + 1..=u64::MAX).prop_map(FrameLength::Huge),
    ];
    (
        header,
        prop_oneof![3 => Just(None), 1 => any::<u32>().prop_map(Some)],
        prop::collection::vec(any::<u8>(), 0..64),
        length,
    )
        .prop_map(|(header, header_length, payload, length)| Frame {
            header,
            header_length,
            payload,
            length,
        })
}

impl Frame {
    fn bytes(&self) -> Vec<u8> {
        let header_length = self.header_length.unwrap_or(self.header.len() as u32);
        let mut body = header_length.to_le_bytes().to_vec();
        body.extend_from_slice(&self.header);
        body.extend_from_slice(&self.payload);
        let length = match &self.length {
            FrameLength::Exact => body.len() as u64,
            FrameLength::Shorter(i) => i.index(body.len()) as u64,
            FrameLength::Longer(k) => body.len() as u64 + u64::from(*k),
            FrameLength::Huge(n) => *n,
        };
        let mut out = length.to_le_bytes().to_vec();
        out.extend(body);
        out
    }
}

proptest! {
    #![proptest_config(fuzz_config())]

    /// Any wire buffer (a batch's with its manifest, dtypes, shapes, offsets or bytes changed,
    /// or random bytes) decodes to a batch or is refused with a message, never panicking.
    #[test]
    fn data_proto_wire_buffers_never_panic(bytes in wire_buffers()) {
        let device = Default::default();
        returns("DataProto::from_wire", || DataProto::<B>::from_wire(&bytes, &device))?;
    }

    /// A saved batch whose `data_proto.json` or `batch.safetensors` is changed loads or is
    /// refused with a message, never panicking.
    #[test]
    fn saved_data_proto_never_panics(
        rows in 1usize..4,
        width in 1usize..4,
        edits in prop::collection::vec(batch_edit(), 0..4),
        bytes_to_manifest in any::<bool>(),
    ) {
        let dir = tempfile::tempdir().unwrap();
        batch(rows, width).save(dir.path()).unwrap();
        let (manifest_path, tensors_path) =
            (dir.path().join("data_proto.json"), dir.path().join("batch.safetensors"));
        let mut manifest: Value =
            serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
        edit_manifest(&mut manifest, &edits);
        let (mut header, data) = split_st(&std::fs::read(&tensors_path).unwrap());
        edit_tensors(&mut header, &edits);
        let (mut manifest_bytes, mut tensor_bytes) =
            (serde_json::to_vec_pretty(&manifest).unwrap(), encode_st(&header, &data));
        if bytes_to_manifest {
            manifest_bytes = edit_bytes(manifest_bytes, &edits);
        } else {
            tensor_bytes = edit_bytes(tensor_bytes, &edits);
        }
        std::fs::write(&manifest_path, manifest_bytes).unwrap();
        std::fs::write(&tensors_path, tensor_bytes).unwrap();
        let device = Default::default();
        returns("DataProto::load", || DataProto::<B>::load(dir.path(), &device))?;
    }

    /// A column with a zero dimension and huge others (which safetensors accepts with no
    /// bytes) decodes or is refused without the product of its dimensions overflowing.
    #[test]
    fn zero_length_columns_with_huge_dimensions_never_panic(
        dims in prop::collection::vec(
            prop_oneof![Just(1u64 << 32), Just(u64::MAX), 1u64..=u64::MAX],
            1..4,
        ),
        zero_at in any::<Index>(),
        kind in prop::sample::select(vec!["float", "int", "bool"]),
    ) {
        let mut shape = dims;
        let at = zero_at.index(shape.len() + 1);
        shape.insert(at, 0);
        let bytes = zero_length_column(&shape, kind);
        let device = Default::default();
        returns("DataProto::from_wire", || DataProto::<B>::from_wire(&bytes, &device))?;
    }

    /// Any frame a peer sends (header mutated or random, header length wrong, frame length
    /// exact, short, long or huge) is read as a message, the end of the connection, or an
    /// error with a message, never a panic; a length beyond the limit is refused naming it.
    #[test]
    fn wire_frames_never_panic(frame in frames()) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut peer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (stream, _) = listener.accept().unwrap();
        stream.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        peer.write_all(&frame.bytes()).unwrap();
        peer.shutdown(Shutdown::Write).unwrap();
        let (mut rx, _tx) = split(stream).unwrap();
        let first = no_panic("WireReader::recv", || rx.recv())?;
        if let FrameLength::Huge(n) = frame.length {
            match &first {
                Err(message) => prop_assert!(
                    message.contains("limit"),
                    "a frame of {n} bytes: the error does not name the limit: {message}"
                ),
                Ok(_) => {
                    return Err(TestCaseError::fail(format!("a frame of {n} bytes was read")))
                }
            }
        }
        // Only an exact frame leaves the stream at a frame boundary: reading on after a short
        // one would take payload bytes for the next frame's length (up to the 16 GiB limit).
        if matches!(frame.length, FrameLength::Exact) && matches!(first, Ok(Some(_))) {
            let end = no_panic("WireReader::recv", || rx.recv())?;
            prop_assert!(matches!(end, Ok(None)), "after the only frame: {end:?}");
        }
    }
}
