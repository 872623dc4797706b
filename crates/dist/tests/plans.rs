//! The data-parallel plans: balanced groups per rank, the ZeRO-3 partition's round trip,
//! and resharding a checkpoint to another world size.

use floe_dist::{
    balance_groups, balance_whole_groups, reshard_reads, FlatPartition, GroupPiece, GroupShape,
};
use proptest::prelude::*;

fn shape(prompt: usize, responses: &[usize]) -> GroupShape {
    GroupShape {
        prompt_tokens: prompt,
        response_tokens: responses.to_vec(),
    }
}

fn tokens(groups: &[GroupShape], pieces: &[GroupPiece]) -> usize {
    pieces
        .iter()
        .map(|p| {
            groups[p.group].prompt_tokens
                + groups[p.group].response_tokens[p.responses.clone()]
                    .iter()
                    .sum::<usize>()
        })
        .sum()
}

#[test]
fn whole_groups_balanced_by_tokens() {
    let groups = [
        shape(10, &[50, 50]), // 110
        shape(10, &[5, 5]),   // 20
        shape(10, &[40, 40]), // 90
        shape(10, &[10, 10]), // 30
    ];
    let ranks = balance_groups(&groups, 2);
    let whole = |g: usize| GroupPiece {
        group: g,
        responses: 0..2,
    };
    // Largest first: 110 -> rank 0, 90 -> rank 1, 30 -> rank 1, 20 -> rank 0.
    assert_eq!(
        ranks,
        vec![vec![whole(0), whole(1)], vec![whole(2), whole(3)]]
    );
    assert_eq!(
        balance_groups(&groups, 1),
        vec![(0..4).map(whole).collect::<Vec<_>>()]
    );
}

#[test]
fn fewer_groups_than_ranks_split_the_largest() {
    let groups = [shape(4, &[10, 10, 10, 30]), shape(4, &[1, 1])];
    let ranks = balance_groups(&groups, 3);
    // Group 0 (64 tokens) splits into [0..3) (34) and [3..4) (34); group 1 stays whole.
    assert_eq!(
        ranks,
        vec![
            vec![GroupPiece {
                group: 0,
                responses: 0..3
            }],
            vec![GroupPiece {
                group: 0,
                responses: 3..4
            }],
            vec![GroupPiece {
                group: 1,
                responses: 0..2
            }],
        ]
    );
    // One response can't split: a rank stays empty.
    let ranks = balance_groups(&[shape(1, &[5])], 2);
    assert_eq!(ranks[1], vec![]);
}

#[test]
fn whole_groups_never_split_and_leave_spare_ranks_empty() {
    let groups = [shape(4, &[10, 10, 10, 30]), shape(4, &[1, 1])];
    let whole = |g: usize, n: usize| GroupPiece {
        group: g,
        responses: 0..n,
    };
    assert_eq!(
        balance_whole_groups(&groups, 3),
        vec![vec![whole(0, 4)], vec![whole(1, 2)], vec![]]
    );
    // With enough groups it assigns as balance_groups does.
    let many = [
        shape(10, &[50, 50]),
        shape(10, &[5, 5]),
        shape(10, &[40, 40]),
    ];
    assert_eq!(balance_whole_groups(&many, 2), balance_groups(&many, 2));
}

fn groups_strategy() -> impl Strategy<Value = Vec<GroupShape>> {
    prop::collection::vec(
        (0usize..50, prop::collection::vec(0usize..200, 0..6)).prop_map(|(p, r)| shape(p, &r)),
        0..24,
    )
}

proptest! {
    #[test]
    fn every_response_once_and_balanced(groups in groups_strategy(), world_size in 1usize..6) {
        let ranks = balance_groups(&groups, world_size);
        prop_assert_eq!(ranks.len(), world_size);
        prop_assert_eq!(&ranks, &balance_groups(&groups, world_size), "deterministic");
        // Every response of every group exactly once.
        let mut seen: Vec<Vec<u32>> = groups.iter().map(|g| vec![0; g.response_tokens.len()]).collect();
        for pieces in &ranks {
            for p in pieces {
                for r in p.responses.clone() {
                    seen[p.group][r] += 1;
                }
            }
            let order: Vec<_> = pieces.iter().map(|p| (p.group, p.responses.start)).collect();
            let mut sorted = order.clone();
            sorted.sort();
            prop_assert_eq!(order, sorted, "pieces in input order");
        }
        prop_assert!(seen.iter().flatten().all(|&n| n == 1));
        // Groups are split only when there are fewer than ranks.
        let nonempty = groups.iter().filter(|g| !g.response_tokens.is_empty()).count();
        let pieces: usize = ranks.iter().map(Vec::len).sum();
        if nonempty >= world_size {
            prop_assert_eq!(pieces, nonempty);
        }
        // Greedy onto the least loaded rank: totals differ by at most the largest piece.
        let loads: Vec<usize> = ranks.iter().map(|p| tokens(&groups, p)).collect();
        let largest = ranks.iter().flatten().map(|p| tokens(&groups, std::slice::from_ref(p))).max().unwrap_or(0);
        prop_assert!(loads.iter().max().unwrap() - loads.iter().min().unwrap() <= largest, "{:?}", loads);
    }
}

#[test]
fn partition_pads_to_the_world_size() {
    let plan = FlatPartition::new(&[3, 5, 2], 4);
    assert_eq!(
        (plan.len(), plan.shard_len(), plan.padded_len()),
        (10, 3, 12)
    );
    assert_eq!(plan.shard_range(2), 6..9);
    let pieces = plan.pieces(1);
    assert_eq!(pieces.len(), 1);
    assert_eq!(
        (
            pieces[0].tensor,
            pieces[0].in_tensor.clone(),
            pieces[0].in_shard.clone()
        ),
        (1, 0..3, 0..3)
    );
    let last = plan.pieces(3);
    assert_eq!(
        (
            last[0].tensor,
            last[0].in_tensor.clone(),
            last[0].in_shard.clone()
        ),
        (2, 1..2, 0..1)
    );
    let a = [1.0f32, 2.0, 3.0];
    let b = [4.0f32, 5.0, 6.0, 7.0, 8.0];
    let c = [9.0f32, 10.0];
    assert_eq!(
        plan.shard(&[&a, &b, &c], 3),
        vec![10.0, 0.0, 0.0],
        "padding is zero"
    );
}

fn tensors_strategy() -> impl Strategy<Value = Vec<Vec<i64>>> {
    prop::collection::vec(prop::collection::vec(any::<i64>(), 0..40), 0..6)
}

fn shards_of(plan: &FlatPartition, tensors: &[Vec<i64>]) -> Vec<Vec<i64>> {
    let slices: Vec<&[i64]> = tensors.iter().map(Vec::as_slice).collect();
    (0..plan.world_size())
        .map(|r| plan.shard(&slices, r))
        .collect()
}

proptest! {
    #[test]
    fn scatter_then_gather_is_the_identity(tensors in tensors_strategy(), world_size in 1usize..9) {
        let lens: Vec<usize> = tensors.iter().map(Vec::len).collect();
        let plan = FlatPartition::new(&lens, world_size);
        prop_assert_eq!(plan.padded_len() % world_size, 0);
        prop_assert!(plan.padded_len() - plan.len() < world_size);
        let shards = shards_of(&plan, &tensors);
        let slices: Vec<&[i64]> = shards.iter().map(Vec::as_slice).collect();
        prop_assert_eq!(plan.gather(&slices), tensors);
    }

    #[test]
    fn resharding_gives_the_full_tensors_back(
        tensors in tensors_strategy(),
        saved_world in 1usize..9,
        new_world in 1usize..9,
    ) {
        let lens: Vec<usize> = tensors.iter().map(Vec::len).collect();
        let saved = FlatPartition::new(&lens, saved_world);
        let saved_shards = shards_of(&saved, &tensors);
        let new = saved.with_world_size(new_world);
        let new_shards: Vec<Vec<i64>> = (0..new_world)
            .map(|rank| {
                let mut shard = vec![0; new.shard_len()];
                for copy in reshard_reads(&saved, &new, rank) {
                    shard[copy.to].copy_from_slice(&saved_shards[copy.from_rank][copy.from]);
                }
                shard
            })
            .collect();
        prop_assert_eq!(&new_shards, &shards_of(&new, &tensors), "padding stays zero");
        let slices: Vec<&[i64]> = new_shards.iter().map(Vec::as_slice).collect();
        prop_assert_eq!(new.gather(&slices), tensors);
    }
}
