//! Which rank takes which sequence groups: equal tokens per rank, groups kept whole.

use std::ops::Range;

/// The token counts of one group: a prompt and its responses (GRPO's samples of it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupShape {
    /// Tokens of the prompt, counted once per rank that holds part of the group (packing
    /// shares the prompt among its responses).
    pub prompt_tokens: usize,
    /// Tokens of each response.
    pub response_tokens: Vec<usize>,
}

/// A group, or a run of its responses, given to one rank.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupPiece {
    /// Index of the group in the input.
    pub group: usize,
    /// Which of its responses.
    pub responses: Range<usize>,
}

impl GroupShape {
    fn tokens(&self, responses: Range<usize>) -> usize {
        self.prompt_tokens + self.response_tokens[responses].iter().sum::<usize>()
    }
}

/// Assigns `groups` to `world_size` ranks so that each rank gets about the same number of
/// tokens; a pure function, so every rank computes the same assignment.
///
/// Groups stay whole (their advantages and the prompt-mean reduction need all of a group,
/// and its prompt is then computed once) unless there are fewer groups than ranks: then
/// the largest groups are split, response runs of about equal tokens, until every rank
/// can get a piece. Pieces go largest first to the rank with the fewest tokens so far
/// (ties: the lower rank), so the ranks' totals differ by at most the largest piece. Each
/// rank's pieces come in input order. Groups without responses carry nothing to train and
/// are left out.
pub fn balance_groups(groups: &[GroupShape], world_size: usize) -> Vec<Vec<GroupPiece>> {
    assert!(world_size > 0, "balance_groups: world size 0");
    let mut pieces: Vec<GroupPiece> = groups
        .iter()
        .enumerate()
        .filter(|(_, g)| !g.response_tokens.is_empty())
        .map(|(group, g)| GroupPiece {
            group,
            responses: 0..g.response_tokens.len(),
        })
        .collect();
    let tokens = |p: &GroupPiece| groups[p.group].tokens(p.responses.clone());
    while pieces.len() < world_size {
        // The largest piece that can split; the first of equals, so the result is fixed.
        let Some(largest) = (0..pieces.len())
            .filter(|&i| pieces[i].responses.len() > 1)
            .max_by_key(|&i| (tokens(&pieces[i]), std::cmp::Reverse(i)))
        else {
            break;
        };
        let piece = pieces[largest].clone();
        let at = even_split(&groups[piece.group].response_tokens[piece.responses.clone()]);
        let mid = piece.responses.start + at;
        pieces[largest].responses = piece.responses.start..mid;
        pieces.insert(
            largest + 1,
            GroupPiece {
                group: piece.group,
                responses: mid..piece.responses.end,
            },
        );
    }
    assign(groups, pieces, world_size)
}

/// Assigns `groups` to `world_size` ranks as [`balance_groups`] does, but never splits a
/// group: with fewer groups than ranks, the last ranks get none. What training needs
/// where a loss reduction or an advantage reads a whole group (`prompt_mean`, the
/// group statistics): a rank then holds all of each of its groups.
pub fn balance_whole_groups(groups: &[GroupShape], world_size: usize) -> Vec<Vec<GroupPiece>> {
    assert!(world_size > 0, "balance_whole_groups: world size 0");
    let pieces = groups
        .iter()
        .enumerate()
        .filter(|(_, g)| !g.response_tokens.is_empty())
        .map(|(group, g)| GroupPiece {
            group,
            responses: 0..g.response_tokens.len(),
        })
        .collect();
    assign(groups, pieces, world_size)
}

/// `pieces` to ranks, largest first onto the rank with the fewest tokens so far (ties:
/// the lower rank); each rank's pieces in input order.
fn assign(
    groups: &[GroupShape],
    pieces: Vec<GroupPiece>,
    world_size: usize,
) -> Vec<Vec<GroupPiece>> {
    let tokens = |p: &GroupPiece| groups[p.group].tokens(p.responses.clone());
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(tokens(&pieces[i])), i));
    let mut load = vec![0usize; world_size];
    let mut ranks: Vec<Vec<usize>> = vec![Vec::new(); world_size];
    for i in order {
        let rank = (0..world_size)
            .min_by_key(|&r| (load[r], r))
            .expect("world size > 0");
        load[rank] += tokens(&pieces[i]);
        ranks[rank].push(i);
    }
    ranks
        .into_iter()
        .map(|mut indices| {
            indices.sort_unstable();
            indices.into_iter().map(|i| pieces[i].clone()).collect()
        })
        .collect()
}

/// Where to cut `responses` (at least two) into two non-empty runs of the most equal
/// token sums; the first such cut.
fn even_split(responses: &[usize]) -> usize {
    let total: usize = responses.iter().sum();
    let mut left = 0;
    let mut best = (usize::MAX, 1);
    for (cut, &tokens) in responses[..responses.len() - 1].iter().enumerate() {
        left += tokens;
        let gap = left.abs_diff(total - left);
        if gap < best.0 {
            best = (gap, cut + 1);
        }
    }
    best.1
}
