//! DataProto: row operations keep tensors, non-tensor values and meta_info in step.

use burn::tensor::{Int, Tensor, TensorData};
use proptest::prelude::*;
use serde_json::{json, Value};
use verl_core::backend::CpuBackend as B;
use verl_core::error::DataProtoError;
use verl_core::DataProto;

/// A batch of `len` rows whose every column encodes the row index, so any row shuffle is visible.
fn batch(len: usize) -> DataProto<B> {
    let d = Default::default();
    let mut p = DataProto::<B>::new();
    let ids: Vec<i64> = (0..len as i64 * 3).collect();
    p.insert_int(
        "input_ids",
        Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [len, 3]), &d),
    )
    .unwrap();
    let f: Vec<f32> = (0..len * 2 * 2).map(|i| i as f32 * 0.5).collect();
    p.insert_float(
        "values",
        Tensor::<B, 3>::from_data(TensorData::new(f, [len, 2, 2]), &d),
    )
    .unwrap();
    let mask: Vec<bool> = (0..len).map(|i| i % 2 == 0).collect();
    p.insert_bool(
        "even",
        Tensor::<B, 1, burn::tensor::Bool>::from_data(TensorData::new(mask, [len]), &d),
    )
    .unwrap();
    p.insert_non_tensor("uid", (0..len).map(|i| json!(format!("u{i}"))).collect())
        .unwrap();
    p.meta_info.insert("temperature".into(), json!(1.0));
    p
}

fn row_ids(p: &DataProto<B>) -> Vec<usize> {
    let ids = p
        .to_data("input_ids")
        .unwrap()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap();
    let from_tensor: Vec<usize> = ids.chunks(3).map(|r| (r[0] / 3) as usize).collect();
    let from_uid: Vec<usize> = p
        .non_tensor("uid")
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap()[1..].parse().unwrap())
        .collect();
    let vals = p.to_data("values").unwrap().to_vec::<f32>().unwrap();
    let from_vals: Vec<usize> = vals.chunks(4).map(|r| (r[0] / 2.0) as usize).collect();
    let even = p.to_data("even").unwrap().to_vec::<bool>().unwrap();
    assert_eq!(
        from_tensor, from_uid,
        "tensor and non-tensor rows out of step"
    );
    assert_eq!(from_tensor, from_vals, "int and float rows out of step");
    assert!(
        from_tensor
            .iter()
            .zip(&even)
            .all(|(i, e)| (i % 2 == 0) == *e),
        "bool rows out of step"
    );
    from_tensor
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 48,
        rng_seed: proptest::test_runner::RngSeed::Fixed(0x7665_726c),
        ..ProptestConfig::default()
    })]

    /// Narrowing the positions of a `[rows, width, a, b]` per-position column keeps, per row,
    /// exactly the entries of positions `start..start + len` (a naive loop over the flat
    /// values); a column of another width, and a rank-3 column not named per-position whose
    /// second dimension only happens to equal the width, are left alone.
    #[test]
    fn narrowing_positions_keeps_each_positions_whole_entry(
        rows in 1usize..4,
        width in 1usize..7,
        a in 1usize..4,
        b in 1usize..3,
        cut in (0usize..7, 1usize..7),
    ) {
        let start = cut.0 % width;
        let len = 1 + (cut.1 - 1) % (width - start);
        let d = Default::default();
        let n = rows * width * a * b;
        let values: Vec<i64> = (0..n as i64).collect();
        let mut p = DataProto::<B>::new();
        p.insert_int(
            "routed_experts",
            Tensor::<B, 4, Int>::from_data(TensorData::new(values.clone(), [rows, width, a, b]), &d),
        )
        .unwrap();
        p.insert_int(
            "other",
            Tensor::<B, 2, Int>::from_data(TensorData::new(vec![7i64; rows * (width + 1)], [rows, width + 1]), &d),
        )
        .unwrap();
        let q = p.narrow_columns(width, start, len);
        let got: Vec<i64> = q
            .int::<4>("routed_experts")
            .unwrap()
            .into_data()
            .convert::<i64>()
            .to_vec()
            .unwrap();
        let entry = a * b;
        let mut want = Vec::new();
        for r in 0..rows {
            for w in start..start + len {
                let at = (r * width + w) * entry;
                want.extend_from_slice(&values[at..at + entry]);
            }
        }
        prop_assert_eq!(got, want);
        prop_assert_eq!(q.int::<2>("other").unwrap().dims(), [rows, width + 1]);
        let mut r = DataProto::<B>::new();
        r.insert_int(
            "position_ids",
            Tensor::<B, 3, Int>::from_data(TensorData::new(vec![1i64; rows * width * 2], [rows, width, 2]), &d),
        )
        .unwrap();
        prop_assert_eq!(
            r.narrow_columns(width, start, len).int::<3>("position_ids").unwrap().dims(),
            [rows, width, 2]
        );
    }

    #[test]
    fn chunk_then_concat_is_identity(chunks in 1usize..6, per in 0usize..5) {
        let p = batch(chunks * per);
        let parts = p.chunk(chunks).unwrap();
        prop_assert_eq!(parts.len(), chunks);
        prop_assert!(parts.iter().all(|c| c.len() == per));
        let back = DataProto::concat(parts).unwrap();
        prop_assert_eq!(row_ids(&back), (0..chunks * per).collect::<Vec<_>>());
        prop_assert_eq!(back.meta_info, p.meta_info);
    }

    #[test]
    fn repeat_interleave_is_grpo_group_layout(len in 1usize..7, n in 1usize..5) {
        let p = batch(len);
        let grouped = p.repeat(n, true).unwrap();
        let expected: Vec<usize> = (0..len).flat_map(|i| std::iter::repeat_n(i, n)).collect();
        prop_assert_eq!(row_ids(&grouped), expected);
        let tiled = p.repeat(n, false).unwrap();
        let expected: Vec<usize> = (0..n).flat_map(|_| 0..len).collect();
        prop_assert_eq!(row_ids(&tiled), expected);
    }

    #[test]
    fn pad_then_unpad_round_trips(len in 1usize..12, divisor in 1usize..6) {
        let p = batch(len);
        let (padded, pad) = p.pad_to_divisor(divisor).unwrap();
        prop_assert_eq!(padded.len() % divisor, 0);
        prop_assert!(pad < divisor);
        // Padding repeats rows from the start.
        let ids = row_ids(&padded);
        for (k, &r) in ids[len..].iter().enumerate() {
            prop_assert_eq!(r, k % len);
        }
        prop_assert_eq!(row_ids(&padded.unpad(pad).unwrap()), (0..len).collect::<Vec<_>>());
    }

    #[test]
    fn reorder_applies_the_permutation(perm in Just((0usize..8).collect::<Vec<_>>()).prop_shuffle()) {
        let mut p = batch(8);
        p.reorder(&perm).unwrap();
        prop_assert_eq!(row_ids(&p), perm);
    }

    #[test]
    fn split_sizes_partition_the_rows(sizes in prop::collection::vec(0usize..4, 1..5)) {
        let total: usize = sizes.iter().sum();
        let p = batch(total);
        let parts = p.split(&sizes).unwrap();
        let mut start = 0;
        for (part, &s) in parts.iter().zip(&sizes) {
            prop_assert_eq!(row_ids(part), (start..start + s).collect::<Vec<_>>());
            start += s;
        }
    }
}

#[test]
fn chunk_refuses_indivisible_length() {
    let err = batch(5).chunk(2).unwrap_err();
    assert!(matches!(
        err,
        DataProtoError::NotDivisible { len: 5, chunks: 2 }
    ));
    assert!(err.to_string().contains("pad_to_divisor"));
}

#[test]
fn union_refuses_conflicts_and_accepts_equal_keys() {
    let a = batch(4);
    let b = batch(4);
    let merged = a.clone().union(b).unwrap();
    assert_eq!(merged.len(), 4);

    let mut c = DataProto::<B>::new();
    c.insert_non_tensor("uid", vec![json!("x"); 4]).unwrap();
    let err = a.clone().union(c).unwrap_err();
    assert!(
        matches!(err, DataProtoError::UnionConflict { ref key } if key == "uid"),
        "{err}"
    );

    let err = a.clone().union(batch(3)).unwrap_err();
    assert!(matches!(
        err,
        DataProtoError::UnionLength { left: 4, right: 3 }
    ));

    let mut d = DataProto::<B>::new();
    d.meta_info.insert("temperature".into(), json!(0.5));
    assert!(matches!(
        a.union(d).unwrap_err(),
        DataProtoError::UnionConflict { .. }
    ));
}

#[test]
fn select_pop_and_missing_keys() {
    let mut p = batch(3);
    let s = p.select(Some(&["values"]), Some(&[]), None).unwrap();
    assert_eq!(s.batch_keys().collect::<Vec<_>>(), vec!["values"]);
    assert_eq!(s.non_tensor_keys().count(), 0);
    assert_eq!(s.meta_info, p.meta_info);

    let err = p.pop(&["values", "nope"], &[], &[]).unwrap_err();
    assert!(
        err.to_string().contains("nope") && err.to_string().contains("input_ids"),
        "{err}"
    );
    assert!(
        p.contains("values"),
        "a failed pop must not remove anything"
    );

    let popped = p.pop(&["values"], &["uid"], &["temperature"]).unwrap();
    assert_eq!(popped.len(), 3);
    assert!(!p.contains("values") && !p.contains("uid") && p.meta_info.is_empty());
    assert!(p.contains("input_ids"));
}

#[test]
fn typed_access_checks_kind_rank_and_length() {
    let mut p = batch(2);
    let v: Tensor<B, 3> = p.float("values").unwrap();
    assert_eq!(v.dims(), [2, 2, 2]);
    assert!(matches!(
        p.float::<2>("values"),
        Err(DataProtoError::RankMismatch {
            expected: 2,
            found: 3,
            ..
        })
    ));
    assert!(matches!(
        p.float::<2>("input_ids"),
        Err(DataProtoError::KindMismatch { .. })
    ));
    let err = p
        .insert_float(
            "x",
            Tensor::<B, 1>::from_floats([1.0, 2.0, 3.0], &Default::default()),
        )
        .unwrap_err();
    assert!(matches!(
        err,
        DataProtoError::LengthMismatch {
            expected: 2,
            found: 3,
            ..
        }
    ));
    assert!(p.insert_non_tensor("uid", vec![Value::Null]).is_err());
    assert_eq!(
        p.non_tensor("uid").unwrap().len(),
        2,
        "a refused replacement keeps the old column"
    );
}

#[test]
fn hand_checked_select_rows_and_slice() {
    let p = batch(5);
    assert_eq!(
        row_ids(&p.select_rows(&[4, 0, 0, 2]).unwrap()),
        vec![4, 0, 0, 2]
    );
    assert_eq!(row_ids(&p.slice(1, 3).unwrap()), vec![1, 2]);
    assert!(matches!(
        p.select_rows(&[5]),
        Err(DataProtoError::RowOutOfRange { index: 5, len: 5 })
    ));
    let ids = p
        .select_rows(&[3])
        .unwrap()
        .to_data("input_ids")
        .unwrap()
        .convert::<i64>()
        .to_vec::<i64>()
        .unwrap();
    assert_eq!(ids, vec![9, 10, 11]);
}

#[test]
fn concat_refuses_mismatched_keys_and_meta() {
    let a = batch(2);
    let mut b = batch(2);
    b.pop(&["values"], &[], &[]).unwrap();
    assert!(matches!(
        DataProto::concat(vec![a.clone(), b]),
        Err(DataProtoError::ConcatKeys { index: 1, .. })
    ));
    let mut c = batch(2);
    c.meta_info.insert("temperature".into(), json!(0.7));
    assert!(matches!(
        DataProto::concat(vec![a, c]),
        Err(DataProtoError::ConcatMeta { .. })
    ));
    assert!(matches!(
        DataProto::<B>::concat(vec![]),
        Err(DataProtoError::ConcatEmpty)
    ));
}

#[test]
fn save_and_load_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let p = batch(6);
    p.save(dir.path()).unwrap();
    let q = DataProto::<B>::load(dir.path(), &Default::default()).unwrap();
    assert_eq!(row_ids(&q), (0..6).collect::<Vec<_>>());
    for key in ["input_ids", "values", "even"] {
        assert_eq!(p.to_data(key).unwrap(), q.to_data(key).unwrap(), "{key}");
        assert_eq!(
            p.column(key).unwrap().shape(),
            q.column(key).unwrap().shape()
        );
    }
    assert_eq!(q.meta_info, p.meta_info);

    // Saving again over the same directory replaces it whole.
    batch(2).save(dir.path()).unwrap();
    assert_eq!(
        DataProto::<B>::load(dir.path(), &Default::default())
            .unwrap()
            .len(),
        2
    );

    let missing = DataProto::<B>::load(dir.path().join("nope"), &Default::default()).unwrap_err();
    assert!(matches!(missing, DataProtoError::Io { .. }));
}

#[test]
fn empty_and_non_tensor_only_batches() {
    let mut p = DataProto::<B>::new();
    assert_eq!(p.len(), 0);
    p.insert_non_tensor("text", vec![json!("a"), json!("b"), json!("c"), json!("d")])
        .unwrap();
    assert_eq!(p.len(), 4);
    let parts = p.chunk(2).unwrap();
    assert_eq!(
        parts[1].non_tensor("text").unwrap(),
        &[json!("c"), json!("d")]
    );
    assert_eq!(
        p.repeat(2, true).unwrap().non_tensor("text").unwrap()[1],
        json!("a")
    );
}

#[test]
fn concat_gathers_per_part_metrics_into_lists() {
    let mut a = batch(2);
    a.meta_info.insert(
        "metrics".into(),
        json!({"actor/pg_loss": 0.5, "actor/grad_norm": [1.0, 2.0]}),
    );
    let mut b = batch(2);
    b.meta_info
        .insert("metrics".into(), json!({"actor/pg_loss": 0.25}));
    let c = batch(2);
    let out = DataProto::concat(vec![a, b, c]).unwrap();
    assert_eq!(
        out.meta_info["metrics"],
        json!({"actor/pg_loss": [0.5, 0.25], "actor/grad_norm": [1.0, 2.0]})
    );
    // Other keys must still agree.
    assert_eq!(out.meta_info["temperature"], json!(1.0));
}

/// A batch crosses a process boundary as bytes (`to_wire` / `from_wire`) with every tensor's
/// kind, shape and values, the non-tensor columns and meta_info; bad bytes are refused.
#[test]
fn wire_round_trip_keeps_kinds_shapes_and_columns() {
    let d = Default::default();
    let mut p = batch(5);
    p.meta_info.insert("global_steps".into(), json!(7));
    let q = DataProto::<B>::from_wire(&p.to_wire().unwrap(), &d).unwrap();
    assert_eq!(q.len(), 5);
    let keys: Vec<&str> = p.batch_keys().collect();
    assert_eq!(q.batch_keys().collect::<Vec<_>>(), keys);
    for key in keys {
        let (a, b) = (p.column(key).unwrap(), q.column(key).unwrap());
        assert_eq!(b.kind(), a.kind(), "{key}");
        assert_eq!(b.shape(), a.shape(), "{key}");
        assert_eq!(q.to_data(key).unwrap(), p.to_data(key).unwrap(), "{key}");
    }
    assert_eq!(q.non_tensor("uid").unwrap(), p.non_tensor("uid").unwrap());
    assert_eq!(q.meta_info, p.meta_info);
    // An empty batch crosses too; bytes that are not a batch are refused.
    let empty = DataProto::<B>::new();
    assert_eq!(
        DataProto::<B>::from_wire(&empty.to_wire().unwrap(), &d)
            .unwrap()
            .len(),
        0
    );
    let bad = DataProto::<B>::from_wire(b"not a batch", &d).unwrap_err();
    assert!(matches!(bad, DataProtoError::Format { .. }), "{bad}");
}
