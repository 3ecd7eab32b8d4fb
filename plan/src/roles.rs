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
//! exchanges counts first). The buffer's rows are split evenly over the
//! attention ranks, so one attention rank may send each MoE rank at most
//! [`Post::rows`] rows per step. The combine is pulled from the same rows
//! of the MoE rank's `combine` buffer.
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
/// `offset` of the MoE rank's unified buffer.
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
}

/// The prefill→decode KV transfer: whole pages of the attention servers'
/// one page format, copied page by page after the request's prefill step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KvHandoff {
    pub page_tokens: u32,
    pub page_bytes: u64,
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
    /// The dispatch schedule: every (attention rank, MoE rank) pair once.
    pub posts: Vec<Post>,
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
    /// The dispatch posts over `rows` rows of `row_bytes` at `offset`: each
    /// attention rank an equal share of every MoE rank's buffer.
    pub fn posts(gpus: &[Role], rows: u64, row_bytes: u64, offset: u64) -> Vec<Post> {
        let attn: Vec<u32> = (0..gpus.len() as u32).filter(|&r| gpus[r as usize].attends()).collect();
        let share = rows / (attn.len() as u64).max(1);
        let mut out = Vec::new();
        for dst in (0..gpus.len() as u32).filter(|&r| gpus[r as usize] == Role::Moe) {
            for (i, &src) in attn.iter().enumerate() {
                let first_row = i as u64 * share;
                out.push(Post { src, dst, first_row, rows: share, offset: offset + first_row * row_bytes });
            }
        }
        out
    }
}
