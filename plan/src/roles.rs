//! ExpertPlex roles (§3): which GPU is a prefill attention server, a decode
//! attention server or a MoE server, realized from the layout search's best
//! layout (§6.3), with the communication schedule between them. PD
//! disaggregation (the papers' PD baseline) is the same structure without
//! MoE servers: whole-model instances of prefill or decode GPUs, each
//! instance its own EP group ([`Roles::ep_groups`]), every GPU holding
//! every region.
//!
//! A role plan keeps one unified buffer per GPU and one [`MemoryPlan`]:
//! the workspace regions (`comm`, `scratch`, `requests`) sit at the same
//! offsets on every GPU, and behind them each role's own regions overlay
//! the same addresses: attention servers hold the replicated weights, the
//! full attention weights and the KV pool; MoE servers hold the expert
//! slots. [`crate::memory::Region::roles`] says which roles hold a region.
//!
//! **Dispatch** is attention-initiated and one-sided (§5): each attention
//! rank writes its token rows into a region of each MoE rank's `dispatch`
//! buffer reserved for it ([`Post`]), so no source waits for another to
//! learn its offsets (DeepEP's low-latency layout; its normal mode instead
//! exchanges counts first). Each decode server's region holds one full
//! decode step (the search's B_d over the decode servers) and the prefill
//! servers share the rest, so one attention rank may send each MoE rank at
//! most [`Post::rows`] rows per round (a prefill step's more go in rounds). The combine is
//! pulled from the same rows of the MoE rank's `combine` buffer. A step of M micro-batches
//! gives micro-batch m the m-th share of every region, in the buffer's m-th slice. Each post
//! names its [`Path`]: NVLink inside a node; across nodes decode goes
//! straight over RDMA on the high-priority virtual lane, and prefill goes
//! once to a prefill server on the destination node that fans out over
//! NVLink (the hierarchical path, on links decode does not use), or
//! straight on the low-priority lane where that node has no prefill server.
//!
//! **KV handoff**: after a request's prefill step its KV pages move, page
//! by page, from its prefill server's pool to a decode server's pool; the
//! request scheduler (in the runtime's engine) picks both servers.
//!
//! [`MemoryPlan`]: crate::memory::MemoryPlan

use serde::{Deserialize, Serialize};

/// What a GPU does in an ExpertPlex deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Prefill attention server: data-parallel attention over new prompts.
    Prefill,
    /// Decode attention server: data-parallel attention over running requests.
    Decode,
    /// MoE server: routed experts for both phases (the APK).
    Moe,
}

impl Role {
    pub const ALL: [Role; 3] = [Role::Prefill, Role::Decode, Role::Moe];

    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
            Role::Moe => "moe",
        }
    }
    /// Whether the role runs attention (and so holds weights and KV).
    pub fn attends(self) -> bool {
        !matches!(self, Role::Moe)
    }
}

/// One attention rank's reserved rows in one MoE rank's `dispatch` (and
/// `combine`) buffer: rows `[first_row, first_row + rows)`, at byte
/// `offset` of the MoE rank's unified buffer, and the path its rows take.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Post {
    /// The attention rank that writes.
    pub src: u32,
    /// The MoE rank written to.
    pub dst: u32,
    pub first_row: u64,
    pub rows: u64,
    /// Byte offset of the first reserved row of `dispatch` on `dst`.
    pub offset: u64,
    pub path: Path,
}

/// How a post's rows reach the MoE rank (ExpertPlex §5).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    /// Same node: a one-sided write over NVLink.
    Nvlink,
    /// Another node, straight over RDMA on InfiniBand virtual lane `lane`:
    /// 0 (high priority) for decode, 1 for prefill when the scale-out link
    /// has two lanes ([`Roles::lanes`]), so decode goes first where the
    /// phases share a link.
    Rdma { lane: u32 },
    /// Prefill to a node holding a prefill server: each row crosses the
    /// scale-out network once, to prefill server `via` on the MoE rank's
    /// node (the one with the sender's local rank, else the nearest), which
    /// holds it in its `dispatch` rows (an attention server receives none)
    /// and forwards it over NVLink to every MoE rank there that needs it;
    /// the combine gathers on `via` (a bf16 partial sum of the rows its
    /// node computed, in the same rows) and returns once. The RDMA link
    /// between two prefill servers carries no decode traffic.
    Relay { via: u32 },
}

/// The prefill→decode KV transfer: whole pages of the attention servers'
/// one page format, copied page by page after the request's prefill step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHandoff {
    pub page_tokens: u32,
    pub page_bytes: u64,
}

/// Whether every node holding MoE servers holds the same number: a
/// replicated placement over the MoE servers needs that (its topology is
/// nodes × GPUs per node, and Zepp's swaps stay within one of its nodes).
pub fn uniform_moe(per_node: &[[u32; 3]]) -> bool {
    let mut counts = per_node.iter().map(|n| n[0]).filter(|&m| m > 0);
    let first = counts.next();
    counts.all(|m| Some(m) == first)
}

/// The realized ExpertPlex layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Roles {
    /// The role of each GPU, by rank.
    pub gpus: Vec<Role>,
    /// Per node `[moe, prefill, decode]` GPUs: the searched layout (the
    /// search's best candidate), laid out MoE servers first on each node.
    pub per_node: Vec<[u32; 3]>,
    /// The GPUs each expert-parallel group spans, in rank order: ExpertPlex
    /// one group (its MoE servers, which every attention server routes to),
    /// PD one per whole-model instance (its GPUs route within it).
    pub ep_groups: Vec<Vec<u32>>,
    /// The decode SM budget q the APK of every MoE server runs with (PD: 0,
    /// its phases never share a GPU).
    pub q: u32,
    /// The goodput the search predicted for this layout, requests/s.
    pub goodput: f64,
    /// How each phase's layers overlap communication with computation: the
    /// search's choice (PD: the baselines' TBO prefill, SBO decode).
    pub overlap: crate::cost::step::Overlaps,
    /// The dispatch schedule: every (attention rank, MoE rank) pair once.
    pub posts: Vec<Post>,
    /// Virtual lanes the scale-out link gives the schedule: 1, or 2 when
    /// prefill's direct RDMA rides a lower-priority lane than decode's.
    pub lanes: u32,
    pub kv_handoff: KvHandoff,
}

impl Roles {
    /// Whether attention and experts are on different GPUs (ExpertPlex),
    /// rather than whole-model instances (PD).
    pub fn moe_servers(&self) -> bool {
        self.gpus.contains(&Role::Moe)
    }
    /// The EP group GPU `rank`'s routed rows go to: its own instance (PD),
    /// or the MoE servers (ExpertPlex).
    pub fn group_of(&self, rank: u32) -> Option<&[u32]> {
        match self.ep_groups.as_slice() {
            [one] => Some(one),
            many => many.iter().find(|g| g.contains(&rank)).map(Vec::as_slice),
        }
    }
    /// Whether GPU `rank` holds experts (it is in an EP group).
    pub fn holds_experts(&self, rank: u32) -> bool {
        self.ep_groups.iter().any(|g| g.contains(&rank))
    }
    /// The ranks holding `role`, in rank order.
    pub fn ranks(&self, role: Role) -> Vec<u32> {
        (0..self.gpus.len() as u32).filter(|&r| self.gpus[r as usize] == role).collect()
    }
    /// The attention ranks (prefill then decode servers interleaved by rank).
    pub fn attention_ranks(&self) -> Vec<u32> {
        (0..self.gpus.len() as u32).filter(|&r| self.gpus[r as usize].attends()).collect()
    }
    /// Lays out ranks node by node: on each node its MoE servers first, then
    /// its prefill, then its decode servers.
    pub fn lay_out(per_node: &[[u32; 3]]) -> Vec<Role> {
        per_node
            .iter()
            .flat_map(|&[m, p, d]| {
                std::iter::repeat_n(Role::Moe, m as usize)
                    .chain(std::iter::repeat_n(Role::Prefill, p as usize))
                    .chain(std::iter::repeat_n(Role::Decode, d as usize))
            })
            .collect()
    }
    /// The dispatch posts over `rows` rows of `row_bytes` at `offset`, and
    /// each post's [`Path`] on nodes of `gpus_per_node` GPUs with `lanes`
    /// virtual lanes on the scale-out link. Decode is the latency-critical
    /// phase: each decode server first gets the rows one full decode step
    /// of it can send one MoE rank (`decode_tokens`, the search's B_d over
    /// the decode servers, rounded up: a token sends a MoE rank at most one
    /// row), so a decode step never waits for a second round; the prefill
    /// servers share the rest evenly and send larger steps in rounds. When
    /// the buffer cannot hold that, every attention rank gets an equal share.
    /// The decode servers' regions come first in every MoE rank's buffer, so
    /// a decode step's rows stay at its head: a MoE server scanning its
    /// received rows for a decode step reads only the decode regions.
    pub fn posts(
        gpus: &[Role],
        gpus_per_node: u32,
        lanes: u32,
        decode_tokens: f64,
        (rows, row_bytes, offset): (u64, u64, u64),
    ) -> Vec<Post> {
        let attn: Vec<u32> = (0..gpus.len() as u32).filter(|&r| gpus[r as usize].attends()).collect();
        let decoders = attn.iter().filter(|&&r| gpus[r as usize] == Role::Decode).count() as u64;
        let prefillers = attn.len() as u64 - decoders;
        let step = if decode_tokens.is_finite() && decode_tokens >= 1.0 { decode_tokens.ceil() as u64 } else { 1 };
        let reserved = step.checked_mul(decoders).filter(|&r| prefillers > 0 && r + prefillers <= rows);
        let even = rows / (attn.len() as u64).max(1);
        let share = |r: u32| match reserved {
            Some(_) if gpus[r as usize] == Role::Decode => step,
            Some(held) => (rows - held) / prefillers,
            None => even,
        };
        let mut out = Vec::new();
        let mut order = attn.clone();
        order.sort_by_key(|&r| (gpus[r as usize] != Role::Decode, r));
        for dst in (0..gpus.len() as u32).filter(|&r| gpus[r as usize] == Role::Moe) {
            let mut first_row = 0;
            for &src in &order {
                let path = Self::path(gpus, gpus_per_node, lanes, src, dst);
                let n = share(src);
                out.push(Post { src, dst, first_row, rows: n, offset: offset + first_row * row_bytes, path });
                first_row += n;
            }
        }
        out
    }

    /// The path from attention rank `src` to MoE rank `dst` (§5): NVLink
    /// within a node; decode straight over RDMA on the high-priority lane;
    /// prefill through the remote node's prefill server with the sender's
    /// local rank (else the nearest local rank, the lower on a tie), or,
    /// where that node has none, straight over RDMA on the low-priority
    /// lane when there are two.
    pub fn path(gpus: &[Role], gpus_per_node: u32, lanes: u32, src: u32, dst: u32) -> Path {
        let g = gpus_per_node.max(1);
        let (node, dst_node) = (src / g, dst / g);
        if node == dst_node {
            return Path::Nvlink;
        }
        if gpus.get(src as usize) != Some(&Role::Prefill) {
            return Path::Rdma { lane: 0 };
        }
        let local = src % g;
        let relay = (0..gpus.len() as u32)
            .filter(|&r| r / g == dst_node && gpus[r as usize] == Role::Prefill)
            .min_by_key(|&r| ((r % g).abs_diff(local), r));
        match relay {
            Some(via) => Path::Relay { via },
            None => Path::Rdma { lane: u32::from(lanes >= 2) },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Path, Role, Roles};

    /// Two nodes of four, laid out by hand: node 0 = [moe, prefill, prefill,
    /// decode], node 1 = [moe, moe, prefill, decode]; then node 1 without a
    /// prefill server.
    #[test]
    fn paths_follow_the_roles_and_nodes() {
        let gpus = Roles::lay_out(&[[1, 2, 1], [2, 1, 1]]);
        use Role::*;
        assert_eq!(gpus, [Moe, Prefill, Prefill, Decode, Moe, Moe, Prefill, Decode]);
        let path = |src, dst| Roles::path(&gpus, 4, 2, src, dst);
        // Same node: NVLink, whatever the role.
        assert_eq!(path(1, 0), Path::Nvlink);
        assert_eq!(path(7, 4), Path::Nvlink);
        // Decode across nodes: RDMA, high priority.
        assert_eq!(path(3, 4), Path::Rdma { lane: 0 });
        assert_eq!(path(7, 0), Path::Rdma { lane: 0 });
        // Prefill 1 (local rank 1) to node 1: its only prefill server is 6
        // (local rank 2), the nearest.
        assert_eq!(path(1, 5), Path::Relay { via: 6 });
        // Prefill 6 (local rank 2) to node 0: rank 2 is a prefill server.
        assert_eq!(path(6, 0), Path::Relay { via: 2 });
        // Node 1 without a prefill server: prefill goes straight, on lane 1
        // with two lanes, on decode's lane with one.
        let gpus = Roles::lay_out(&[[1, 2, 1], [2, 0, 2]]);
        assert_eq!(Roles::path(&gpus, 4, 2, 1, 4), Path::Rdma { lane: 1 });
        assert_eq!(Roles::path(&gpus, 4, 1, 1, 4), Path::Rdma { lane: 0 });
        // Ties go to the lower local rank: prefill 2 to a node whose prefill
        // servers sit at local ranks 1 and 3.
        let gpus = [Moe, Moe, Prefill, Decode, Moe, Prefill, Decode, Prefill];
        assert_eq!(Roles::path(&gpus, 4, 2, 2, 4), Path::Relay { via: 5 });
    }
}
