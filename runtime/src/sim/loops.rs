//! The serving loops. A *unified* engine runs both phases on the same GPUs,
//! one iteration at a time, prefill first (SGLang's scheduler): colocated
//! serving, chunked prefill, static TP, static EP and Moebius switching. A
//! *split* engine runs a prefill side and a decode side concurrently, each
//! iterating on its own attention groups: instance-level PD
//! disaggregation, PD-Multiplexing on Green Contexts and ExpertPlex. Admission is
//! in arrival order ([`crate::batching::admit_fifo`]). The unified engine
//! admits as SGLang's scheduler does ([`TokenRatio`]): running requests are
//! charged an estimated share of their remaining outputs, and a decode step
//! that would overflow a group's KV first retracts requests, which later
//! prefill their prompt and generated tokens again. The split engines reserve
//! each request's whole output on the decode side before its prefill.
//! Moebius consults the same [`Coordinator`] the CPU twin runs.

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

/// A request on a group: prompt tokens to prefill (its prompt, or prompt
/// and generated tokens after a retraction), those done, outputs left.
#[derive(Clone, Copy, Debug)]
struct Run {
    id: usize,
    target: u32,
    prefilled: u32,
    left: u32,
}

/// SGLang's admission estimate (`global_config.py`, `scheduler.py`,
/// `schedule_policy.py`): a running request is charged `now` × its
/// remaining outputs (at most [`CLIP_MAX_NEW_TOKENS`]); a request admitted in
/// this round is charged its prompt and whole output. The ratio starts at
/// `init` = 0.7 × `--schedule-conservativeness` (1, or 0.3 under DP
/// attention, [`DP_ATTENTION_CONSERVATIVENESS`]), decays linearly to
/// `init` × 0.14 over 600 decode steps that retract nothing, and after a
/// retraction is reset to (tokens decoded + 20 per running request) / their
/// outputs, at most 1.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TokenRatio {
    pub now: f64,
    pub init: f64,
}

impl Default for TokenRatio {
    /// SGLang's default conservativeness (1).
    fn default() -> TokenRatio {
        TokenRatio::new(1.0)
    }
}

pub const INIT_NEW_TOKEN_RATIO: f64 = 0.7;
pub const MIN_NEW_TOKEN_RATIO_FACTOR: f64 = 0.14;
pub const NEW_TOKEN_RATIO_DECAY_STEPS: f64 = 600.0;
pub const RETRACT_DECODE_STEPS: f64 = 20.0;
pub const CLIP_MAX_NEW_TOKENS: f64 = 4096.0;
/// SGLang's `server_args` multiplies `--schedule-conservativeness` by 0.3
/// when DP attention is enabled (the same block that divides
/// `--chunked-prefill-size` by the DP size), so each DP rank's scheduler
/// starts its estimate at 0.21 and floors it at 0.0294.
pub const DP_ATTENTION_CONSERVATIVENESS: f64 = 0.3;

impl TokenRatio {
    /// A fresh estimate at `conservativeness` (SGLang's `init_new_token_ratio`).
    pub fn new(conservativeness: f64) -> TokenRatio {
        let init = (INIT_NEW_TOKEN_RATIO * conservativeness).min(1.0);
        TokenRatio { now: init, init }
    }
    /// The estimate of an engine whose attention runs as `groups` groups:
    /// DP attention where there are several.
    fn of_groups(groups: usize) -> TokenRatio {
        TokenRatio::new(if groups > 1 { DP_ATTENTION_CONSERVATIVENESS } else { 1.0 })
    }
    fn floor(self) -> f64 {
        (self.init * MIN_NEW_TOKEN_RATIO_FACTOR).min(1.0)
    }
    /// Started over (an idle scheduler).
    fn reset(self) -> TokenRatio {
        TokenRatio { now: self.init, ..self }
    }
    fn decayed(self) -> TokenRatio {
        let step = (self.init - self.floor()) / NEW_TOKEN_RATIO_DECAY_STEPS;
        TokenRatio { now: (self.now - step).max(self.floor()), ..self }
    }
    /// After a retraction on a group: its running requests' decoded share,
    /// padded: (Σ len(output_ids) + 20 per request) / Σ max_new_tokens, at most 1.
    fn after_retraction(self, g: &Group, reqs: &[Req]) -> TokenRatio {
        let (mut decoded, mut outputs) = (0.0, 0.0);
        for r in &g.decode {
            let out = f64::from(reqs[r.id].output);
            decoded += out - f64::from(r.left);
            outputs += out;
        }
        if outputs <= 0.0 {
            return self.reset();
        }
        let n = g.decode.len() as f64;
        TokenRatio { now: ((decoded + RETRACT_DECODE_STEPS * n) / outputs).min(1.0), ..self }
    }
}

#[derive(Clone, Debug, Default)]
struct Group {
    /// Admitted, prompt not finished (in admission order).
    prefill: Vec<Run>,
    decode: Vec<Run>,
    reserved: f64,
    /// The group's own admission estimate (SGLang runs one scheduler per DP rank).
    ratio: TokenRatio,
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
    /// Tokens the group's KV will hold after its next step.
    fn used(&self, reqs: &[Req]) -> f64 {
        self.prefill.iter().map(|r| held(r, true, reqs)).sum::<f64>()
            + self.decode.iter().map(|r| held(r, false, reqs)).sum::<f64>()
    }
    /// KV tokens the group holds after this iteration (its prompts being
    /// prefilled counted whole): a decoding request gains its next token
    /// only on a decode step, so a prefill step may follow a decode step
    /// that filled the KV to the last token.
    fn after_step(&self, reqs: &[Req], decoding: bool) -> f64 {
        self.used(reqs) - if decoding { 0.0 } else { self.decode.len() as f64 }
    }
    /// SGLang's charge for the running requests' future outputs.
    fn future(&self) -> f64 {
        self.prefill.iter().chain(&self.decode).map(|r| f64::from(r.left).min(CLIP_MAX_NEW_TOKENS)).sum::<f64>()
            * self.ratio.now
    }
}

/// `n` empty attention groups, one SGLang scheduler each with its own
/// admission estimate (DP attention's conservativeness where there are
/// several).
fn schedulers(n: usize) -> Vec<Group> {
    vec![Group { ratio: TokenRatio::of_groups(n), ..Group::default() }; n]
}

/// Tokens one request's KV holds after its group's next step: a prompt
/// being prefilled in full (with the token it samples), a decoding request
/// with its next token.
fn held(r: &Run, prefilling: bool, reqs: &[Req]) -> f64 {
    if prefilling {
        f64::from(r.target) + 1.0
    } else {
        f64::from(reqs[r.id].input + reqs[r.id].output - r.left)
    }
}

/// One SGLang admission round on a unified engine (`PrefillAdder`): each
/// waiting request in arrival order goes to the least-loaded group where
/// its prompt (a retracted request's prompt and outputs so far) and whole
/// output fit beside what the group holds, its running requests' estimated
/// outputs and the requests admitted before it in this round, and where the
/// round's prompt tokens stay within `budget` (the first prompt of an idle
/// group always fits, as one prefill step takes it whole or in chunks).
fn admit_estimated(
    groups: &mut [Group],
    cap: f64,
    budget: f64,
    waiting: &mut VecDeque<usize>,
    resume: &mut [Option<u32>],
    reqs: &[Req],
) {
    let mut charged: Vec<f64> = groups.iter().map(|g| g.used(reqs) + g.future()).collect();
    let mut room: Vec<f64> = groups
        .iter()
        .map(|g| budget - g.prefill.iter().map(|r| f64::from(r.target - r.prefilled)).sum::<f64>())
        .collect();
    admit_fifo(waiting, |id| {
        let r = &reqs[id];
        // A resumed request re-prefills its prompt and every output so far.
        let left = resume[id].unwrap_or(r.output - 1);
        let target = match resume[id] {
            Some(left) => r.input + r.output - left,
            None => r.input,
        };
        let need = f64::from(target) + 1.0 + f64::from(left).min(CLIP_MAX_NEW_TOKENS);
        let best = (0..groups.len())
            .filter(|&g| charged[g] + need <= cap)
            .filter(|&g| f64::from(target) <= room[g] || groups[g].prefill.is_empty())
            .min_by(|&a, &b| groups[a].tokens(reqs).total_cmp(&groups[b].tokens(reqs)).then(a.cmp(&b)));
        match best {
            Some(g) => {
                charged[g] += need;
                room[g] -= f64::from(target);
                groups[g].prefill.push(Run { id, target, prefilled: 0, left });
                resume[id] = None;
                true
            }
            None => false,
        }
    });
}

/// Before a step that decodes (SGLang's `update_running_batch`): while a
/// group's KV cannot take every decoding request's next token, retracts the
/// request SGLang's `retract_decode` picks (the fewest generated tokens,
/// then the longest prompt) to the back of the queue, and resets that
/// group's estimate; a group that decodes and retracts nothing decays its
/// estimate one step. Returns how many were retracted.
fn retract(
    groups: &mut [Group],
    cap: f64,
    waiting: &mut VecDeque<usize>,
    resume: &mut [Option<u32>],
    reqs: &[Req],
) -> usize {
    let mut n = 0;
    for g in groups.iter_mut() {
        let mut any = false;
        while g.used(reqs) > cap && !g.decode.is_empty() {
            let generated = |r: &Run| reqs[r.id].output - r.left;
            let Some(i) = (0..g.decode.len()).min_by(|&a, &b| {
                let (x, y) = (&g.decode[a], &g.decode[b]);
                generated(x).cmp(&generated(y)).then(reqs[y.id].input.cmp(&reqs[x.id].input)).then(y.id.cmp(&x.id))
            }) else {
                break;
            };
            let r = g.decode.remove(i);
            resume[r.id] = Some(r.left);
            waiting.push_back(r.id);
            any = true;
            n += 1;
        }
        if any {
            g.ratio = g.ratio.after_retraction(g, reqs);
        } else if !g.decode.is_empty() {
            g.ratio = g.ratio.decayed();
        }
    }
    n
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
            let target = reqs[id].input;
            if prefilled {
                groups[g].decode.push(Run { id, target, prefilled: target, left });
            } else {
                groups[g].prefill.push(Run { id, target, prefilled: 0, left });
            }
            true
        }
        None => false,
    }
}

/// Builds one prefill iteration: each group takes its admitted prompts in
/// order, up to `budget` new tokens (a prompt longer than the budget is
/// split into chunks when `chunked`, else taken whole by an empty group).
fn prefill_loads(groups: &[Group], budget: f64, chunked: bool) -> (Vec<Load>, Vec<Vec<(usize, u32)>>) {
    let mut loads = vec![Load::default(); groups.len()];
    let mut takes = vec![Vec::new(); groups.len()];
    for (g, group) in groups.iter().enumerate() {
        let mut left = budget;
        for (i, r) in group.prefill.iter().enumerate() {
            let rest = f64::from(r.target - r.prefilled);
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
/// their first token (a resumed request already has) and move to decode.
fn finish_prefill(groups: &mut [Group], takes: &[Vec<(usize, u32)>], t: f64, book: &mut Book) {
    for (g, takes) in takes.iter().enumerate() {
        for &(i, n) in takes {
            groups[g].prefill[i].prefilled += n;
        }
        let (done, rest): (Vec<Run>, Vec<Run>) = groups[g].prefill.iter().partition(|r| r.prefilled >= r.target);
        groups[g].prefill = rest;
        let mut resumed = Vec::new();
        for r in done {
            if book.out[r.id].ttft.is_none() {
                book.first_token(r.id, t);
                groups[g].decode.push(r);
            } else {
                // A resumed request's prefill samples its next token, as a decode step would.
                resumed.push(r);
            }
        }
        // (Only the unified engine resumes; it keeps no reservations to free.)
        book.decoded(&mut resumed, t);
        groups[g].decode.extend(resumed);
    }
}

/// What a unified engine did: per-request outcomes, when each switch
/// completed, and how many times a request was retracted.
pub(super) struct Served {
    pub out: Vec<Outcome>,
    pub switches: Vec<f64>,
    pub retractions: usize,
}

/// One engine on every GPU: colocated, chunked prefill, static TP/EP, Moebius.
pub(super) fn unified(
    env: &Env,
    chunked_prefill: Option<f64>,
    (tp, ep): (Option<Shape>, Option<Shape>),
    switch: Option<&Switching>,
    reqs: &[Req],
) -> Served {
    let mut book = Book { reqs, out: vec![Outcome::default(); reqs.len()], first: vec![0.0; reqs.len()] };
    let mut switches = Vec::new();
    let mut retractions = 0;
    let (Some(tp_shape), Some(ep_shape)) = (tp.or(ep), ep.or(tp)) else {
        return Served { out: book.out, switches, retractions };
    };
    let mut mode =
        if tp.is_some() && (ep.is_none() || switch.is_some_and(|s| s.start == Mode::Tp)) { Mode::Tp } else { Mode::Ep };
    let shape = |mode: Mode| if mode == Mode::Tp { tp_shape } else { ep_shape };
    let mut coordinator = switch.map(|s| Coordinator::new(s.policy.clone()));
    let mut groups = schedulers(shape(mode).groups as usize);
    // A request must fit a group in every mode the engine may be in (Moebius
    // switches), or it could block the queue in the mode it does not fit.
    let max_cap = [tp, ep].iter().filter_map(|s| s.map(|s| s.kv_per_group)).fold(f64::INFINITY, f64::min);
    let mut waiting: VecDeque<usize> = VecDeque::new();
    // Outputs left of each retracted request waiting to resume.
    let mut resume: Vec<Option<u32>> = vec![None; reqs.len()];
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
            // An idle scheduler starts its estimate over (SGLang resets it with no batch to run).
            for g in groups.iter_mut() {
                g.ratio = g.ratio.reset();
            }
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
        // Prompt tokens a group may take this iteration, and whether a longer
        // prompt is split (Phases::Unified says which engine is which).
        let (budget, split) = match chunked_prefill {
            Some(total) => ((total / groups.len().max(1) as f64).floor().max(1.0), true),
            None => (MAX_PREFILL_TOKENS, false),
        };
        admit_estimated(&mut groups, cap, budget, &mut waiting, &mut resume, reqs);
        let (loads, takes) = prefill_loads(&groups, budget, split);
        let prefill = loads.iter().any(Load::has_prefill);
        // An iteration with prompts is prefill-only (prefill first, SGLang's
        // scheduler; it does not mix chunks into decode batches by default)
        // and decode waits for it.
        let decoding = !prefill;
        if decoding {
            // The step writes every decoding request's next token: make room
            // first. A group's estimate decays on these decode-only steps
            // (a batch carrying prompt tokens does not decay it).
            retractions += retract(&mut groups, cap, &mut waiting, &mut resume, reqs);
        }
        debug_assert!(groups.iter().all(|g| g.after_step(reqs, decoding) <= cap), "a group's KV overflows");
        let loads = if prefill { loads } else { decode_loads(&groups, reqs) };
        let it = env.iteration(&loads, sh.width, 1.0, sh.moe, Sms::all(env.cm.sms), 0.0, sh.overlap);
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
                book.decoded(&mut g.decode, t);
            }
        }
        if prefill {
            finish_prefill(&mut groups, &takes, t, &mut book);
        }
    }
    Served { out: book.out, switches, retractions }
}

/// Redistributes requests over `n` groups of capacity `cap` (Moebius §3.2:
/// all onto every rank for TP; largest first to the least-loaded group for
/// EP) by the KV they hold, under new schedulers whose estimates start over
/// at the new mode's ([`schedulers`]); `None` when they do not fit (the
/// switch is cancelled). Later outputs are the admission estimate's and
/// retraction's business.
fn regroup(groups: &[Group], n: usize, cap: f64, reqs: &[Req]) -> Option<Vec<Group>> {
    let mut runs: Vec<(bool, Run)> = groups
        .iter()
        .flat_map(|g| g.prefill.iter().map(|r| (true, *r)).chain(g.decode.iter().map(|r| (false, *r))))
        .collect();
    runs.sort_by(|a, b| held(&b.1, b.0, reqs).total_cmp(&held(&a.1, a.0, reqs)).then(a.1.id.cmp(&b.1.id)));
    let mut out = schedulers(n);
    let mut used = vec![0.0; n];
    for (pre, r) in runs {
        let need = held(&r, pre, reqs);
        let g = (0..n).filter(|&g| used[g] + need <= cap).min_by(|&a, &b| used[a].total_cmp(&used[b]))?;
        used[g] += need;
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
/// PD disaggregation, PD-Multiplexing (Green Contexts), ExpertPlex.
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
    // PD-Multiplexing's (prefill, decode) SMs for the prefill batch in flight.
    let mut mux_split = (sms, 0.0);
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
            let (loads, takes) = prefill_loads(&pre.groups, MAX_PREFILL_TOKENS, false);
            if !loads.iter().any(Load::has_prefill) {
                // Idle until the next arrival, or, when prompts wait for decode
                // KV, until the decode side's next iteration frees some.
                let arrival = reqs.get(next).map_or(f64::INFINITY, |r| r.arrival.max(t));
                let freed = if waiting.is_empty() { f64::INFINITY } else { dec.busy_until.max(t + 1e-9) };
                pre.busy_until = arrival.min(freed);
                pre.last = Iter::default();
                // No prefill batch in flight: PD-Multiplexing gives decode every SM.
                mux_split = (sms, 0.0);
                if pre.busy_until.is_infinite() && dec.busy_until.is_infinite() {
                    break;
                }
                continue;
            }
            let (d_moe, d_comm) = if dec.running() { dec.duty() } else { (0.0, 0.0) };
            let (share, sm, interference) = match sharing {
                Sharing::Apk { shared, .. } => (
                    1.0,
                    Sms { alone: sms, shared: sms - dec.last_q, contention: d_moe, preempt: 0.0 },
                    d_comm * shared,
                ),
                Sharing::PdMux(mux) => {
                    // The split is chosen now, from the decode batch a
                    // group's scheduler runs (prompts prefilled by now have
                    // merged into it, spread over the groups).
                    let ready = handoff.iter().take_while(|h| h.0 <= t).count();
                    let decoding = dec.groups.iter().map(|g| g.decode.len()).max().unwrap_or(0)
                        + ready.div_ceil(dec.groups.len().max(1));
                    mux_split = mux.split(decoding);
                    let q = mux_split.0;
                    (q / sms, Sms { alone: q, shared: q, contention: 0.0, preempt: 0.0 }, d_comm)
                }
                Sharing::None => (1.0, Sms::all(env.cm.sms), 0.0),
            };
            let it = env.iteration(&loads, ps.width, share, ps.moe, sm, interference, ps.overlap);
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
                Sharing::Apk { q, x_star, q_max, lanes, shared } => {
                    // q' = min(Q_max, ⌈q · x_moe / x*_moe⌉_c) (§6.4, Eq. 4).
                    let rows = loads.iter().map(Load::tokens).sum::<f64>() * env.top_k;
                    let x = env.decode_footprint(rows, ds.moe);
                    let q1 =
                        (f64::from(q) * x / x_star.max(1e-9) / f64::from(env.cluster)).ceil() * f64::from(env.cluster);
                    dec.last_q = q1.clamp(f64::from(env.cluster), f64::from(q_max));
                    (
                        1.0,
                        Sms { alone: sms, shared: dec.last_q, contention: p_moe, preempt: env.tile_seconds / 2.0 },
                        if lanes { 0.0 } else { p_comm * shared },
                    )
                }
                Sharing::PdMux(_) => {
                    // The split held while a prefill batch is in flight, every SM otherwise.
                    let q = if prefill_busy && mux_split.1 > 0.0 { mux_split.1 } else { sms };
                    (q / sms, Sms { alone: q, shared: q, contention: 0.0, preempt: 0.0 }, p_comm)
                }
                Sharing::None => (1.0, Sms::all(env.cm.sms), 0.0),
            };
            let it = env.iteration(&loads, ds.width, share, ds.moe, sm, interference, ds.overlap);
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
    /// Every GPU partitioned by Green Contexts under SGLang's
    /// PD-Multiplexing policy ([`PdMux`]); the phases' traffic shares links.
    PdMux(PdMux),
    /// Shared MoE GPUs under APK: decode holds q' SMs while prefill has MoE
    /// work, every SM otherwise; prefill takes the rest (§4.3, §6.4).
    /// `shared` is the fraction of prefill's attention→MoE traffic that takes
    /// a direct scale-out path decode also uses (to a node without a prefill
    /// server, where the hierarchical path is unavailable, §5); there the
    /// phases contend. With `lanes` (the scale-out link has ≥ 2 virtual
    /// lanes) prefill rides the lower-priority lane: decode's transfers go
    /// first and only prefill's stretch, by decode's link duty. Without,
    /// the link is FIFO and each phase's transfers stretch by the other's duty.
    Apk { q: u32, x_star: f64, q_max: u32, lanes: bool, shared: f64 },
}

/// SGLang's PD-Multiplexing (`--enable-pdmux`, `srt/multiplex/`) with its
/// default configuration: the paper's SGLang-PDMux baseline is "based on the
/// open-source MuxWise implementation" [ExpertPlex ref. 10] and modified for
/// MoE (§7.1); this is the PD-multiplexing scheduler SGLang ships, whose
/// flag the baseline is named after. Each GPU holds Green Contexts of fixed SM counts:
/// - while a prefill batch is in flight the phases run on one of
///   `sm_group_num − 2` splits ([`PdMux::splits`]), where prefill never
///   holds fewer SMs than decode; the split is chosen when the batch starts,
///   from the running decode batch ([`PdMux::split`]), and held until it ends;
/// - with no prefill in flight decode runs on every SM, and with nothing
///   decoding prefill does.
///
/// Not modeled: SGLang's scheduler loop also advances a prefill batch only
/// `split_forward_token_budget / prompt tokens` layers (at least one) per
/// decode step. With that throttle the model puts ExpertPlex 3.9× ahead on
/// MiniMax-M2 LooGLE where the paper measured 1.28×, so the paper's modified
/// baseline cannot pace prefill that way.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PdMux {
    /// SMs per GPU.
    pub sms: u32,
    /// Green Context granularity (`get_arch_constraints`): the smallest
    /// part and the step between part sizes (8 and 8 on sm_90, 4 and 2 on sm_80).
    pub min_part: u32,
    pub step: u32,
    /// `sm_group_num` (8): the all-prefill group, `sm_group_num − 2` splits,
    /// the all-decode group.
    pub groups: u32,
    /// `decode_bs_divisor` (36).
    pub decode_bs_divisor: u32,
}

impl PdMux {
    /// The defaults of SGLang's `PDMuxConfig` on a GPU of `sms` SMs.
    pub fn sglang(sms: u32, arch: moeforge_dsl::spec::Arch) -> PdMux {
        let (min_part, step) = match arch {
            moeforge_dsl::spec::Arch::Sm90a => (8, 8),
            moeforge_dsl::spec::Arch::Sm80 => (4, 2),
        };
        PdMux { sms, min_part, step, groups: 8, decode_bs_divisor: 36 }
    }

    /// The (prefill, decode) SM splits, largest prefill first (`divide_sm`):
    /// prefill never holds fewer SMs than decode, decode at least 16; of the
    /// `a` prefill sizes allowed, every ⌊a / (groups − 2)⌋-th, at most `groups − 2`.
    pub fn splits(&self) -> Vec<(u32, u32)> {
        let n = self.sms;
        let allowed: Vec<u32> = (self.min_part..=n.saturating_sub(self.min_part))
            .step_by(self.step.max(1) as usize)
            .filter(|&x| x >= n - x && n - x >= 16)
            .collect();
        let want = self.groups.saturating_sub(2).max(1) as usize;
        let stride = if allowed.len() >= want { (allowed.len() / want).max(1) } else { 1 };
        let mut out: Vec<(u32, u32)> = allowed.iter().step_by(stride).take(want).map(|&p| (p, n - p)).collect();
        out.reverse();
        out
    }

    /// The (prefill, decode) SMs a prefill batch runs under beside a decode
    /// batch of `decode` requests (`adjust_stream_groups`): of the `n`
    /// splits, the `clamp(decode · n / decode_bs_divisor, 1, n)`-th (counted
    /// from 1); every SM to prefill when nothing decodes.
    pub fn split(&self, decode: usize) -> (f64, f64) {
        let splits = self.splits();
        let n = splits.len();
        if decode == 0 || n == 0 {
            return (f64::from(self.sms), 0.0);
        }
        let i = (decode * n / self.decode_bs_divisor.max(1) as usize).clamp(1, n);
        let (p, d) = splits[i - 1];
        (f64::from(p), f64::from(d))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use moeforge_plan::cost::step::MoeSide;
    use moeforge_plan::cost::CostModel;

    fn req(input: u32, output: u32) -> Req {
        Req { arrival: 0.0, input, output }
    }

    /// Qwen3-235B-A22B on one 8×H200 node (the bursty example), roofline costs.
    fn env() -> Env {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/qwen3-235b-a22b-bursty.moe");
        let checked = moeforge_dsl::check_paths(&[path], &moeforge_dsl::FsLoader)
            .unwrap_or_else(|f| panic!("{}", f.render(false)));
        let s = &checked.spec;
        let d = &s.deploys[0];
        let (m, c, t) = (s.model(d.model), s.cluster(d.cluster), s.tile_set(d.tiles));
        Env::new(m, c, t, d, &CostModel::roofline(m, c, t), 0)
    }

    /// SGLang's `divide_sm` worked by hand. sm_90 (parts of at least 8, in
    /// steps of 8) on 132 SMs: prefill sizes 72–112 keep prefill ≥ decode and
    /// decode ≥ 16, exactly the six splits wanted. sm_80 (at least 4, steps
    /// of 2) on 108 SMs: 54–92 are 20 sizes, every third is taken (54, 60, …, 84).
    #[test]
    fn pdmux_splits_are_sglangs_divide_sm_chosen_by_the_decode_batch() {
        use moeforge_dsl::spec::Arch;
        let h = PdMux::sglang(132, Arch::Sm90a);
        assert_eq!(h.splits(), [(112, 20), (104, 28), (96, 36), (88, 44), (80, 52), (72, 60)]);
        let a = PdMux::sglang(108, Arch::Sm80);
        assert_eq!(a.splits(), [(84, 24), (78, 30), (72, 36), (66, 42), (60, 48), (54, 54)]);
        // clamp(bs · 6 / 36, 1, 6)-th split; nothing decoding: every SM to prefill.
        for (bs, want) in [(0, (132.0, 0.0)), (1, (112.0, 20.0)), (11, (112.0, 20.0)), (12, (104.0, 28.0))] {
            assert_eq!(h.split(bs), want, "decode batch {bs}");
        }
        for bs in [35, 36, 1000] {
            let want = if bs < 36 { (80.0, 52.0) } else { (72.0, 60.0) };
            assert_eq!(h.split(bs), want, "decode batch {bs}");
        }
    }

    #[test]
    fn retraction_takes_the_fewest_generated_tokens_then_the_longest_prompt() {
        // SGLang's retract_decode sorts by (generated, −prompt) and retracts from the small end.
        let reqs = [req(100, 50), req(300, 50), req(200, 50), req(100, 50)];
        let run = |id: usize, left: u32| Run { id, target: reqs[id].input, prefilled: reqs[id].input, left };
        // Generated: 10, 5, 5, 30 tokens; ids 1 and 2 tie on 5, id 1 has the longer prompt.
        let mut groups =
            vec![Group { decode: vec![run(0, 39), run(1, 44), run(2, 44), run(3, 19)], ..Group::default() }];
        let used = groups[0].used(&reqs);
        // Prompt, generated tokens and the next one.
        assert_eq!(used, f64::from((100 + 10 + 1) + (300 + 5 + 1) + (200 + 5 + 1) + (100 + 30 + 1)));
        let (mut waiting, mut resume) = (VecDeque::from([7usize]), vec![None; 8]);
        // One token short: one retraction (id 1) frees 306 tokens.
        assert_eq!(retract(&mut groups, used - 1.0, &mut waiting, &mut resume, &reqs), 1);
        assert_eq!(groups[0].decode.iter().map(|r| r.id).collect::<Vec<_>>(), [0, 2, 3]);
        assert_eq!(resume[1], Some(44));
        // To the back of the queue, as SGLang appends retracted requests.
        assert_eq!(waiting, [7, 1]);
        // The group's estimate resets to (Σ outputs so far + 20 each) / Σ outputs:
        // (11 + 6 + 31 + 60) / 150.
        assert!((groups[0].ratio.now - 108.0 / 150.0).abs() < 1e-12, "{:?}", groups[0].ratio);
        // Room to spare: nothing moves, and the estimate decays one step.
        assert_eq!(retract(&mut groups, 1e9, &mut waiting, &mut resume, &reqs), 0);
        assert_eq!(groups[0].decode.len(), 3);
        let step = (0.7 - 0.098) / 600.0;
        assert!((groups[0].ratio.now - (108.0 / 150.0 - step)).abs() < 1e-12, "{:?}", groups[0].ratio);
    }

    #[test]
    fn the_ratio_decays_to_its_floor_in_600_steps_and_is_reset_by_a_retraction() {
        let mut r = TokenRatio::default();
        assert_eq!(r.now, INIT_NEW_TOKEN_RATIO);
        for _ in 0..599 {
            r = r.decayed();
        }
        assert!(r.now > 0.098 + 1e-9);
        r = r.decayed();
        assert!((r.now - 0.098).abs() < 1e-9, "{}", r.now);
        assert_eq!(r.decayed(), r);
        // Two running requests with 11 and 31 of 100 and 200 outputs so far:
        // (42 + 20·2) / 300.
        let reqs = [req(8, 100), req(8, 200)];
        let group = Group {
            decode: vec![
                Run { id: 0, target: 8, prefilled: 8, left: 89 },
                Run { id: 1, target: 8, prefilled: 8, left: 169 },
            ],
            ..Group::default()
        };
        assert!((TokenRatio::default().after_retraction(&group, &reqs).now - 82.0 / 300.0).abs() < 1e-12);
        assert_eq!(Group::default().ratio.now, 0.7);
        // DP attention's schedulers start at 0.7 × 0.3 and floor at 0.21 × 0.14.
        assert_eq!(schedulers(1)[0].ratio, TokenRatio::default());
        let mut dp = schedulers(8)[7].ratio;
        assert!((dp.now - 0.21).abs() < 1e-12, "{dp:?}");
        for _ in 0..600 {
            dp = dp.decayed();
        }
        assert!((dp.now - 0.0294).abs() < 1e-12, "{dp:?}");
        assert_eq!(dp.reset().now, dp.init);
    }

    #[test]
    fn estimated_admission_overcommits_retracts_within_kv_and_finishes_every_request() {
        let env = env();
        let side = MoeSide::Ep { gpus: 8, nodes: 1, replicas: 1, local: 1.0, disaggregated: false };
        // Two groups of 20k tokens; 80 requests of 200 + 800 tokens at once:
        // the whole-output reservation would run 20 per group at a time.
        let cap = 20_000.0;
        let shape = Shape {
            groups: 2,
            width: 1,
            moe: side,
            kv_per_group: cap,
            overlap: moeforge_plan::cost::step::Overlaps::STANDARD,
        };
        let reqs: Vec<Req> = (0..80).map(|_| req(200, 800)).collect();
        let served = unified(&env, None, (None, Some(shape)), None, &reqs);
        // Every request finishes with all its outputs (debug builds also
        // check, step by step, that no group's KV overflows).
        assert!(served.out.iter().all(|o| o.ttft.is_some() && o.tpot.is_some() && o.finish.is_some()));
        let first_finish = served.out.iter().filter_map(|o| o.finish).fold(f64::INFINITY, f64::min);
        let started = served.out.iter().filter(|o| o.ttft.is_some_and(|t| t < first_finish)).count();
        let whole_output = 2 * (cap / 1000.0) as usize;
        assert!(started > whole_output, "{started} started before the first finish, whole-output bound {whole_output}");
        // The estimate overcommits: KV runs out mid-decode and requests are retracted.
        assert!(served.retractions > 0);
    }

    /// SGLang's default chunked prefill (not mixed): 8 DP groups share an
    /// 8192-token budget, 1024 tokens each per prefill iteration, so one
    /// 3000-token prompt takes three prefill iterations (its first token
    /// comes after the third) where chunking off takes it whole in one; and
    /// a decode step waits for each.
    #[test]
    fn default_chunked_prefill_splits_a_prompt_by_the_dp_share_of_its_budget() {
        let env = env();
        let side = MoeSide::Ep { gpus: 8, nodes: 1, replicas: 1, local: 1.0, disaggregated: false };
        let shape = Shape {
            groups: 8,
            width: 1,
            moe: side,
            kv_per_group: 1e6,
            overlap: moeforge_plan::cost::step::Overlaps::STANDARD,
        };
        let one = [req(3000, 2)];
        let whole = unified(&env, None, (None, Some(shape)), None, &one).out[0].ttft.unwrap();
        let chunked = unified(&env, Some(8192.0), (None, Some(shape)), None, &one).out[0].ttft.unwrap();
        // The same step time the engine charges, by hand: a lone group's chunks
        // of 1024, 1024 and 952 tokens after 0, 1024 and 2048 cached ones.
        let step = |n: f64, prefix: f64| {
            let mut l = Load::default();
            l.add_chunk(n, prefix);
            let mut loads = vec![Load::default(); 8];
            loads[0] = l;
            env.iteration(&loads, 1, 1.0, side, Sms::all(env.cm.sms), 0.0, shape.overlap).seconds
        };
        let want = step(1024.0, 0.0) + step(1024.0, 1024.0) + step(952.0, 2048.0);
        assert!((chunked / want - 1.0).abs() < 1e-9, "chunked TTFT {chunked} vs three chunks {want}");
        assert!((whole / step(3000.0, 0.0) - 1.0).abs() < 1e-9, "whole TTFT {whole}");
        assert!(chunked > whole);
    }
}
