//! The serving loops. A *unified* engine runs both phases on the same GPUs,
//! one iteration at a time, prefill first (SGLang's scheduler): colocated
//! serving, chunked prefill, static TP, static EP and Moebius switching. A
//! *split* engine runs a prefill side and a decode side concurrently, each
//! iterating on its own attention groups: instance-level PD
//! disaggregation, Green-Context partitioning and ExpertPlex. Admission is
//! the backends' shared rule ([`crate::batching::admit_fifo`]) against the
//! decode groups' KV capacity; Moebius consults the same [`Coordinator`] the
//! CPU twin runs.

use super::workload::Req;
use super::{Outcome, Shape, Switching};
use crate::batching::admit_fifo;
use crate::policy::Coordinator;
use moeforge_plan::cost::step::{Env, Iter, Load, Sms};
use moeforge_plan::memory::Mode;
use std::collections::VecDeque;

/// Largest prompt-token batch one attention group prefills per iteration
/// (SGLang's default `max_prefill_tokens`).
pub const MAX_PREFILL_TOKENS: f64 = 16384.0;

/// A request on a group: prompt tokens done, outputs left, cached tokens.
#[derive(Clone, Copy, Debug)]
struct Run {
    id: usize,
    prefilled: u32,
    left: u32,
}

#[derive(Clone, Debug, Default)]
struct Group {
    /// Admitted, prompt not finished (in admission order).
    prefill: Vec<Run>,
    decode: Vec<Run>,
    reserved: f64,
}

impl Group {
    fn ctx(&self, reqs: &[Req]) -> f64 {
        self.decode.iter().map(|r| f64::from(reqs[r.id].input + reqs[r.id].output - 1 - r.left)).sum()
    }
    fn tokens(&self, reqs: &[Req]) -> f64 {
        self.decode.iter().chain(&self.prefill).map(|r| f64::from(reqs[r.id].input + reqs[r.id].output - r.left)).sum()
    }
    fn requests(&self) -> usize {
        self.prefill.len() + self.decode.len()
    }
}

/// Per-request results being filled in.
struct Book<'a> {
    reqs: &'a [Req],
    out: Vec<Outcome>,
    first: Vec<f64>,
}

impl Book<'_> {
    fn first_token(&mut self, id: usize, t: f64) {
        self.first[id] = t;
        self.out[id].ttft = Some(t - self.reqs[id].arrival);
    }
    /// A decode iteration ended at `t` on `runs`: each gains a token; finished ones leave.
    fn decoded(&mut self, runs: &mut Vec<Run>, t: f64) -> f64 {
        let mut freed = 0.0;
        for r in runs.iter_mut() {
            r.left -= 1;
            if r.left == 0 {
                let req = &self.reqs[r.id];
                self.out[r.id].tpot = Some((t - self.first[r.id]) / f64::from(req.output - 1));
                self.out[r.id].finish = Some(t);
                freed += req.reserve();
            }
        }
        runs.retain(|r| r.left > 0);
        freed
    }
}

/// Places a request on the least-loaded group whose KV has room, to be
/// prefilled there, or straight into decode when its KV arrives prefilled.
fn place(groups: &mut [Group], cap: f64, id: usize, reqs: &[Req], prefilled: bool) -> bool {
    let need = reqs[id].reserve();
    let best = (0..groups.len())
        .filter(|&g| groups[g].reserved + need <= cap)
        .min_by(|&a, &b| groups[a].tokens(reqs).total_cmp(&groups[b].tokens(reqs)).then(a.cmp(&b)));
    match best {
        Some(g) => {
            groups[g].reserved += need;
            let left = reqs[id].output - 1;
            if prefilled {
                groups[g].decode.push(Run { id, prefilled: reqs[id].input, left });
            } else {
                groups[g].prefill.push(Run { id, prefilled: 0, left });
            }
            true
        }
        None => false,
    }
}

/// Builds one prefill iteration: each group takes its admitted prompts in
/// order, up to `budget` new tokens (a prompt longer than the budget is
/// split into chunks when `chunked`, else taken whole by an empty group).
fn prefill_loads(groups: &[Group], budget: f64, chunked: bool, reqs: &[Req]) -> (Vec<Load>, Vec<Vec<(usize, u32)>>) {
    let mut loads = vec![Load::default(); groups.len()];
    let mut takes = vec![Vec::new(); groups.len()];
    for (g, group) in groups.iter().enumerate() {
        let mut left = budget;
        for (i, r) in group.prefill.iter().enumerate() {
            let rest = f64::from(reqs[r.id].input - r.prefilled);
            let take = if rest <= left || (!chunked && !loads[g].has_prefill()) {
                rest
            } else if chunked {
                left
            } else {
                0.0
            };
            if take <= 0.0 {
                break;
            }
            loads[g].add_chunk(take, f64::from(r.prefilled));
            takes[g].push((i, take as u32));
            left -= take;
            if left <= 0.0 {
                break;
            }
        }
    }
    (loads, takes)
}

fn decode_loads(groups: &[Group], reqs: &[Req]) -> Vec<Load> {
    groups.iter().map(|g| Load::decode(g.decode.len() as f64, g.ctx(reqs))).collect()
}

/// Applies a prefill iteration that ended at `t`: finished prompts emit
/// their first token and move to decode.
fn finish_prefill(groups: &mut [Group], takes: &[Vec<(usize, u32)>], t: f64, book: &mut Book) {
    for (g, takes) in takes.iter().enumerate() {
        for &(i, n) in takes {
            groups[g].prefill[i].prefilled += n;
        }
        let reqs = book.reqs;
        let (done, rest): (Vec<Run>, Vec<Run>) =
            groups[g].prefill.iter().partition(|r| r.prefilled >= reqs[r.id].input);
        groups[g].prefill = rest;
        for r in done {
            book.first_token(r.id, t);
            groups[g].decode.push(r);
        }
    }
}

/// One engine on every GPU: colocated, chunked prefill, static TP/EP,
/// Moebius. Returns the outcomes and the times switches completed.
pub(super) fn unified(
    env: &Env,
    chunk: Option<f64>,
    (tp, ep): (Option<Shape>, Option<Shape>),
    switch: Option<&Switching>,
    reqs: &[Req],
) -> (Vec<Outcome>, Vec<f64>) {
    let mut book = Book { reqs, out: vec![Outcome::default(); reqs.len()], first: vec![0.0; reqs.len()] };
    let mut switches = Vec::new();
    let (Some(tp_shape), Some(ep_shape)) = (tp.or(ep), ep.or(tp)) else { return (book.out, switches) };
    let mut mode =
        if tp.is_some() && (ep.is_none() || switch.is_some_and(|s| s.start == Mode::Tp)) { Mode::Tp } else { Mode::Ep };
    let shape = |mode: Mode| if mode == Mode::Tp { tp_shape } else { ep_shape };
    let mut coordinator = switch.map(|s| Coordinator::new(s.policy.clone()));
    let mut groups = vec![Group::default(); shape(mode).groups as usize];
    // A request must fit a group in every mode the engine may be in (Moebius
    // switches), or it could block the queue in the mode it does not fit.
    let max_cap = [tp, ep].iter().filter_map(|s| s.map(|s| s.kv_per_group)).fold(f64::INFINITY, f64::min);
    let mut waiting: VecDeque<usize> = VecDeque::new();
    let (mut t, mut next) = (0.0, 0usize);
    loop {
        while next < reqs.len() && reqs[next].arrival <= t {
            // A request no group could ever hold is refused at once (it misses its SLO).
            if reqs[next].reserve() <= max_cap {
                waiting.push_back(next);
            }
            next += 1;
        }
        let inflight = waiting.len() + groups.iter().map(Group::requests).sum::<usize>();
        if inflight == 0 {
            if next == reqs.len() {
                break;
            }
            t = reqs[next].arrival;
            continue;
        }
        if let (Some(c), Some(s)) = (coordinator.as_mut(), switch) {
            if let Some(target) = c.decide(mode, inflight, t) {
                let to = shape(target);
                match regroup(&groups, to.groups as usize, to.kv_per_group, reqs) {
                    Some(moved) => {
                        // Weights move by the plan's descriptors; KV of running requests moves too.
                        let kv: f64 = groups.iter().map(|g| g.tokens(reqs)).sum::<f64>() * env.kv_token;
                        t += s.weight_seconds + env.cm.nvlink(kv / f64::from(env.world));
                        groups = moved;
                        mode = target;
                        c.switched(t);
                        switches.push(t);
                    }
                    None => c.cancelled(t),
                }
            }
        }
        let sh = shape(mode);
        let cap = sh.kv_per_group;
        admit_fifo(&mut waiting, |id| place(&mut groups, cap, id, reqs, false));
        let budget = chunk.unwrap_or(MAX_PREFILL_TOKENS);
        let (loads, takes) = prefill_loads(&groups, budget, chunk.is_some(), reqs);
        let prefill = loads.iter().any(Load::has_prefill);
        // Chunked prefill is SGLang's mixed chunking: every iteration decodes
        // each running request and advances at most `chunk` prompt tokens per
        // group in the same batch. Otherwise an iteration with prompts is
        // prefill-only (prefill first) and decode waits for it.
        let mixed = chunk.is_some();
        let decoding = mixed || !prefill;
        let loads = match (mixed, prefill) {
            (true, _) => decode_loads(&groups, reqs).into_iter().zip(loads).map(|(d, p)| d.mixed(p)).collect(),
            (false, true) => loads,
            (false, false) => decode_loads(&groups, reqs),
        };
        let it = env.iteration(&loads, sh.width, 1.0, sh.moe, Sms::all(env.cm.sms), 0.0);
        if it.seconds <= 0.0 || loads.iter().all(Load::is_empty) {
            // Nothing runnable: KV is full of nothing (cannot happen with the
            // refusal above) or requests wait for the next arrival.
            match reqs.get(next) {
                Some(r) => t = r.arrival.max(t),
                None => break,
            }
            continue;
        }
        t += it.seconds;
        // Requests already decoding gain their token before finished prompts join them.
        if decoding {
            for g in groups.iter_mut() {
                let freed = book.decoded(&mut g.decode, t);
                g.reserved -= freed;
            }
        }
        if prefill {
            finish_prefill(&mut groups, &takes, t, &mut book);
        }
    }
    (book.out, switches)
}

/// Redistributes requests over `n` groups of capacity `cap` (Moebius §3.2:
/// all onto every rank for TP; longest-first to the least-loaded group for
/// EP); `None` when they do not fit (the switch is cancelled).
fn regroup(groups: &[Group], n: usize, cap: f64, reqs: &[Req]) -> Option<Vec<Group>> {
    let mut runs: Vec<(bool, Run)> = groups
        .iter()
        .flat_map(|g| g.prefill.iter().map(|r| (true, *r)).chain(g.decode.iter().map(|r| (false, *r))))
        .collect();
    runs.sort_by(|a, b| reqs[b.1.id].reserve().total_cmp(&reqs[a.1.id].reserve()).then(a.1.id.cmp(&b.1.id)));
    let mut out = vec![Group::default(); n];
    for (pre, r) in runs {
        let need = reqs[r.id].reserve();
        let g = (0..n)
            .filter(|&g| out[g].reserved + need <= cap)
            .min_by(|&a, &b| out[a].reserved.total_cmp(&out[b].reserved))?;
        out[g].reserved += need;
        if pre {
            out[g].prefill.push(r);
        } else {
            out[g].decode.push(r);
        }
    }
    for g in out.iter_mut() {
        g.prefill.sort_by_key(|r| r.id);
        g.decode.sort_by_key(|r| r.id);
    }
    Some(out)
}

/// One side of a split engine.
#[derive(Default)]
struct Side {
    groups: Vec<Group>,
    busy_until: f64,
    /// The last iteration (for the other side's contention estimate).
    last: Iter,
    /// SMs the last decode iteration held under contention (q').
    last_q: f64,
}

impl Side {
    fn running(&self) -> bool {
        self.groups.iter().any(|g| g.requests() > 0)
    }
    fn duty(&self) -> (f64, f64) {
        if self.last.seconds > 0.0 {
            (self.last.moe_seconds / self.last.seconds, self.last.comm_seconds / self.last.seconds)
        } else {
            (0.0, 0.0)
        }
    }
}

/// Prefill and decode on separate attention groups that run concurrently:
/// PD disaggregation, Green Context, ExpertPlex.
pub(super) fn split(
    env: &Env,
    ps: &Shape,
    ds: &Shape,
    sharing: Sharing,
    kv_transfer: bool,
    reqs: &[Req],
) -> Vec<Outcome> {
    let mut book = Book { reqs, out: vec![Outcome::default(); reqs.len()], first: vec![0.0; reqs.len()] };
    let sms = f64::from(env.cm.sms);
    let mut pre = Side { groups: vec![Group::default(); ps.groups as usize], ..Side::default() };
    let mut dec = Side { groups: vec![Group::default(); ds.groups as usize], ..Side::default() };
    let mut waiting: VecDeque<usize> = VecDeque::new();
    // Prompts done, waiting for their KV to reach a decode group: (ready time, id).
    let mut handoff: VecDeque<(f64, usize)> = VecDeque::new();
    // Decode KV is committed before a prompt is prefilled (as PD systems
    // pre-allocate it), so a full decode side delays prefill and shows in
    // TTFT rather than as a pause after the first token.
    let decode_kv = f64::from(ds.groups) * ds.kv_per_group;
    let mut committed = 0.0;
    let mut next = 0usize;
    loop {
        let t = pre.busy_until.min(dec.busy_until);
        while next < reqs.len() && reqs[next].arrival <= t {
            if reqs[next].reserve() <= ds.kv_per_group {
                waiting.push_back(next);
            }
            next += 1;
        }
        if waiting.is_empty() && handoff.is_empty() && !pre.running() && !dec.running() {
            match reqs.get(next) {
                Some(r) => {
                    pre.busy_until = pre.busy_until.max(r.arrival);
                    dec.busy_until = dec.busy_until.max(r.arrival);
                    continue;
                }
                None => break,
            }
        }
        if pre.busy_until <= dec.busy_until {
            // Prefill side: every waiting prompt goes to the least-loaded group, up to the budget.
            for g in pre.groups.iter_mut() {
                g.reserved = 0.0;
            }
            let mut room = pre.groups.len() as f64 * MAX_PREFILL_TOKENS;
            admit_fifo(&mut waiting, |id| {
                let n = f64::from(reqs[id].input);
                if n > room && pre.groups.iter().any(|g| !g.prefill.is_empty()) {
                    return false;
                }
                if committed + reqs[id].reserve() > decode_kv {
                    return false;
                }
                room -= n;
                committed += reqs[id].reserve();
                place(&mut pre.groups, f64::INFINITY, id, reqs, false)
            });
            let (loads, takes) = prefill_loads(&pre.groups, MAX_PREFILL_TOKENS, false, reqs);
            if !loads.iter().any(Load::has_prefill) {
                // Idle until the next arrival, or, when prompts wait for decode
                // KV, until the decode side's next iteration frees some.
                let arrival = reqs.get(next).map_or(f64::INFINITY, |r| r.arrival.max(t));
                let freed = if waiting.is_empty() { f64::INFINITY } else { dec.busy_until.max(t + 1e-9) };
                pre.busy_until = arrival.min(freed);
                pre.last = Iter::default();
                if pre.busy_until.is_infinite() && dec.busy_until.is_infinite() {
                    break;
                }
                continue;
            }
            let (d_moe, d_comm) = if dec.running() { dec.duty() } else { (0.0, 0.0) };
            let (share, sm, interference) = match sharing {
                Sharing::Apk { .. } => {
                    (1.0, Sms { alone: sms, shared: sms - dec.last_q, contention: d_moe, preempt: 0.0 }, 0.0)
                }
                Sharing::Green { prefill_share } => {
                    let q = sms * prefill_share;
                    (prefill_share, Sms { alone: q, shared: q, contention: 0.0, preempt: 0.0 }, d_comm)
                }
                Sharing::None => (1.0, Sms::all(env.cm.sms), 0.0),
            };
            let it = env.iteration(&loads, ps.width, share, ps.moe, sm, interference);
            let end = t + it.seconds;
            pre.busy_until = end;
            pre.last = it;
            finish_prefill(&mut pre.groups, &takes, end, &mut book);
            for g in pre.groups.iter_mut() {
                for r in g.decode.drain(..) {
                    let ready = end + if kv_transfer { env.kv_move(f64::from(reqs[r.id].input)) } else { 0.0 };
                    handoff.push_back((ready, r.id));
                }
            }
            // Ready in time order, so one long transfer does not hold back the others.
            handoff.make_contiguous().sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
        } else {
            // Decode side: admit handed-off requests whose KV fits, then one iteration.
            let cap = ds.kv_per_group;
            let mut ready: VecDeque<usize> = handoff.iter().take_while(|h| h.0 <= t).map(|h| h.1).collect();
            let n = admit_fifo(&mut ready, |id| place(&mut dec.groups, cap, id, reqs, true));
            handoff.drain(..n);
            if !dec.running() {
                dec.busy_until = match handoff.front() {
                    Some(h) if h.0 > t => h.0,
                    // KV full cannot happen with nothing running; wait for the prefill side.
                    _ => pre.busy_until.max(t + 1e-6),
                };
                dec.last = Iter::default();
                if dec.busy_until.is_infinite() {
                    break;
                }
                continue;
            }
            let loads = decode_loads(&dec.groups, reqs);
            let prefill_busy = pre.busy_until > t;
            let (p_moe, p_comm) = if prefill_busy { pre.duty() } else { (0.0, 0.0) };
            let (share, sm, interference) = match sharing {
                Sharing::Apk { q, x_star, q_max } => {
                    // q' = min(Q_max, ⌈q · x_moe / x*_moe⌉_c) (§6.4, Eq. 4).
                    let rows = loads.iter().map(Load::tokens).sum::<f64>() * env.top_k;
                    let x = env.decode_footprint(rows, ds.moe);
                    let q1 =
                        (f64::from(q) * x / x_star.max(1e-9) / f64::from(env.cluster)).ceil() * f64::from(env.cluster);
                    dec.last_q = q1.clamp(f64::from(env.cluster), f64::from(q_max));
                    (
                        1.0,
                        Sms { alone: sms, shared: dec.last_q, contention: p_moe, preempt: env.tile_seconds / 2.0 },
                        0.0,
                    )
                }
                Sharing::Green { prefill_share } => {
                    let q = sms * (1.0 - prefill_share);
                    (1.0 - prefill_share, Sms { alone: q, shared: q, contention: 0.0, preempt: 0.0 }, p_comm)
                }
                Sharing::None => (1.0, Sms::all(env.cm.sms), 0.0),
            };
            let it = env.iteration(&loads, ds.width, share, ds.moe, sm, interference);
            let end = t + it.seconds;
            dec.busy_until = end;
            dec.last = it;
            for g in dec.groups.iter_mut() {
                let freed = book.decoded(&mut g.decode, end);
                g.reserved -= freed;
                committed -= freed;
            }
        }
    }
    book.out
}

/// How the phases of a split engine share GPUs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sharing {
    /// Separate GPUs (PD disaggregation).
    None,
    /// Every GPU partitioned: prefill holds `prefill_share` of the SMs for
    /// all its kernels, decode the rest, fixed; their traffic shares links.
    Green { prefill_share: f64 },
    /// Shared MoE GPUs under APK: decode holds q' SMs while prefill has MoE
    /// work, every SM otherwise; prefill takes the rest (§4.3, §6.4).
    Apk { q: u32, x_star: f64, q_max: u32 },
}
