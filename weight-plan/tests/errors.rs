//! Layouts the plan refuses, each with the variant naming what is wrong.

use xfer_weight_plan::{plan, Layout, Param, Piece, PlanError, Select, Shard, Slice, Tensor};

fn tensor(name: &str, shape: &[u64]) -> Tensor {
    Tensor {
        name: name.into(),
        shape: shape.to_vec(),
        elem_size: 2,
    }
}

fn shard(rank: u32, tensor: &str, slice: Slice) -> Shard {
    Shard {
        rank,
        tensor: tensor.into(),
        slice,
    }
}

/// `w` (4x6, 2-byte elements) held in flat halves by ranks 0 and 1, wanted whole on rank 0.
fn base() -> Layout {
    let w = tensor("w", &[4, 6]);
    Layout {
        shards: vec![
            shard(0, "w", Slice::Flat { start: 0, end: 24 }),
            shard(1, "w", Slice::Flat { start: 24, end: 48 }),
        ],
        params: vec![Param::of(0, &w, Select::Whole)],
        tensors: vec![w],
    }
}

#[test]
fn the_base_layout_plans() {
    let p = plan(&base()).unwrap();
    assert_eq!((p.sent, p.received), (vec![24, 24], vec![48]));
}

#[test]
fn bytes_no_rank_holds() {
    let mut l = base();
    l.shards[1].slice = Slice::Flat { start: 24, end: 40 };
    assert!(
        matches!(plan(&l), Err(PlanError::NotHeld { missing: 8, ref tensor, .. }) if tensor == "w")
    );
}

#[test]
fn different_slices_sharing_bytes() {
    let mut l = base();
    l.shards.push(shard(
        2,
        "w",
        Slice::Dim {
            dim: 1,
            start: 0,
            end: 1,
        },
    ));
    assert!(matches!(plan(&l), Err(PlanError::OverlappingShards { .. })));
    let mut l = base();
    l.shards[1].slice = Slice::Flat { start: 20, end: 48 };
    assert!(matches!(
        plan(&l),
        Err(PlanError::OverlappingShards {
            first: 0,
            second: 1,
            ..
        })
    ));
    // Equal slices on two ranks are replicas, not an overlap.
    let mut l = base();
    l.shards
        .push(shard(5, "w", Slice::Flat { start: 24, end: 48 }));
    assert!(plan(&l).is_ok());
}

#[test]
fn pieces_that_overlap_or_leave_gaps() {
    let piece = |row: u64| Piece {
        tensor: "w".into(),
        select: Select::Dim {
            dim: 0,
            start: 0,
            end: 2,
        },
        at: vec![row, 0],
    };
    let mut l = base();
    l.params = vec![Param {
        rank: 0,
        name: "p".into(),
        shape: vec![4, 6],
        elem_size: 2,
        pieces: vec![piece(0), piece(1)],
    }];
    assert!(matches!(
        plan(&l),
        Err(PlanError::OverlappingPieces {
            first: 0,
            second: 1,
            ..
        })
    ));
    l.params[0].pieces = vec![piece(0)];
    assert!(matches!(
        plan(&l),
        Err(PlanError::Uncovered {
            covered: 24,
            size: 48,
            ..
        })
    ));
    l.params[0].pieces = vec![piece(3)];
    assert!(matches!(
        plan(&l),
        Err(PlanError::BadPiece { piece: 0, .. })
    ));
}

#[test]
fn names_sizes_and_slices_checked() {
    let mut l = base();
    l.shards[0].tensor = "v".into();
    assert!(matches!(plan(&l), Err(PlanError::UnknownTensor { ref name, .. }) if name == "v"));
    let mut l = base();
    l.shards[0].slice = Slice::Dim {
        dim: 2,
        start: 0,
        end: 1,
    };
    assert!(matches!(
        plan(&l),
        Err(PlanError::BadSlice { shard: 0, .. })
    ));
    let mut l = base();
    l.params[0].elem_size = 4;
    assert!(matches!(plan(&l), Err(PlanError::BadPiece { .. })));
    let mut l = base();
    l.tensors.push(tensor("w", &[1]));
    assert!(matches!(plan(&l), Err(PlanError::DuplicateTensor { .. })));
    let mut l = base();
    l.tensors[0].shape = vec![u64::MAX, 3];
    assert!(matches!(plan(&l), Err(PlanError::BadTensor { .. })));
}
