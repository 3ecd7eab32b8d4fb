//! The `sim` backend: a discrete-event serving simulator whose iteration
//! times come from the plan's cost model (ExpertPlex §6.2–6.3), comparing
//! the ways of serving one model on one cluster that the papers compare.
//!
//! | system | attention | experts | phases |
//! |---|---|---|---|
//! | `expertplex` | per-phase DP attention servers (the layout search's best) | shared MoE servers | concurrent; decode holds q' SMs under APK, every SM alone |
//! | `pd-disagg` | whole-model instances (the fewest GPUs holding the weights), half prefill, half decode | one copy per instance | concurrent, separate GPUs; KV moves after prefill |
//! | `green-context` | SGLang-PDMux: TP per node on Green Context SM partitions | EP, same partitions | concurrent on every GPU: while a prefill batch is in flight, the SGLang PD-Multiplexing split its decode batch picks; otherwise decode on every SM; shared links |
//! | `colocated` | DP on every GPU | EP on every GPU | one iteration at a time, prefill first |
//! | `chunked-prefill` | as colocated, with SGLang's chunked prefill at the ExpertPlex evaluation's 256 tokens a DP rank | | each chunk re-reads weights and its prefix KV |
//! | `static-tp` / `static-ep` | the dual-mode plan in one mode | | one iteration at a time; SGLang's default chunked prefill (its budget split over DP ranks) |
//! | `moebius` | the dual-mode plan, switching by the §4.5 coordinator | | as static TP/EP; each switch pays the reshard |
//!
//! Differences between systems come only from these mechanisms: the same
//! request stream (seeded), cost model and metrics serve them all. The
//! admission differs by engine, as the served systems' do: a unified engine
//! is SGLang's scheduler (estimated outputs, retraction when KV runs out);
//! a split engine commits each request's whole output on its decode side
//! before prefilling it. Metrics: TTFT, TPOT (mean over a request's outputs), SLO
//! attainment (both met; refused requests miss) and P90 goodput, the highest
//! rate at which ≥ 90% of requests meet both SLOs.

mod loops;
pub mod report;
pub mod workload;

pub use loops::{PdMux, Sharing, MAX_PREFILL_TOKENS};
use moeforge_dsl::spec::Spec;
use moeforge_plan::cost::expected_x_moe;
use moeforge_plan::cost::step::{self as model, Env, MoeSide, Overlaps};
use moeforge_plan::memory::Mode;
use moeforge_plan::memory::Workspace;
use moeforge_plan::search::SearchResult;
use moeforge_plan::Plan;
use workload::Req;

use crate::policy::{crossover, Calibration, Policy};

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum System {
    ExpertPlex,
    PdDisagg,
    GreenContext,
    Colocated,
    ChunkedPrefill,
    StaticTp,
    StaticEp,
    Moebius,
}

impl System {
    pub const ALL: [System; 8] = [
        System::ExpertPlex,
        System::PdDisagg,
        System::GreenContext,
        System::Colocated,
        System::ChunkedPrefill,
        System::StaticTp,
        System::StaticEp,
        System::Moebius,
    ];

    pub fn name(self) -> &'static str {
        match self {
            System::ExpertPlex => "expertplex",
            System::PdDisagg => "pd-disagg",
            System::GreenContext => "green-context",
            System::Colocated => "colocated",
            System::ChunkedPrefill => "chunked-prefill",
            System::StaticTp => "static-tp",
            System::StaticEp => "static-ep",
            System::Moebius => "moebius",
        }
    }

    pub fn parse(s: &str) -> Option<System> {
        System::ALL.into_iter().find(|x| x.name() == s)
    }
}

/// One simulated run: per-request outcomes, the times mode switches
/// completed, and the requests retracted to make KV room (each time counted).
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    pub outcomes: Vec<Outcome>,
    pub switches: Vec<f64>,
    pub retractions: usize,
}

/// Per-request result; `None` for requests that never got that far (refused).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Outcome {
    pub ttft: Option<f64>,
    pub tpot: Option<f64>,
    pub finish: Option<f64>,
}

/// Attention groups of one phase and the MoE side they route to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    /// DP attention groups, each `width` GPUs (TP inside a group).
    pub groups: u32,
    pub width: u32,
    pub moe: MoeSide,
    /// KV tokens one group holds (reservations are checked against it).
    pub kv_per_group: f64,
    /// How the phase's layers overlap communication and computation.
    pub overlap: Overlaps,
}

/// Moebius's switching: the policy, the starting mode and the weight
/// reshard's modeled time per switch.
#[derive(Clone, Debug, PartialEq)]
pub struct Switching {
    pub policy: Policy,
    pub start: Mode,
    pub weight_seconds: f64,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Phases {
    /// Both phases on the same groups, one iteration at a time (prefill
    /// first). With `chunked_prefill`, SGLang's chunked prefill (not mixed
    /// with decode, SGLang's default): a prefill iteration takes at most
    /// that many prompt tokens over all groups (a 1/groups share each, as
    /// SGLang divides `--chunked-prefill-size` by the DP size under DP
    /// attention), splitting longer prompts, and decode waits for it.
    /// Without, a group takes whole prompts up to [`MAX_PREFILL_TOKENS`] per
    /// iteration (chunking off).
    Unified { chunked_prefill: Option<f64>, tp: Option<Shape>, ep: Option<Shape>, switch: Option<Switching> },
    /// Concurrent prefill and decode sides; `kv_transfer` when a prompt's KV
    /// moves from the prefill GPU to the decode GPU (over RDMA when `remote`).
    Split { prefill: Shape, decode: Shape, sharing: Sharing, kv_transfer: bool },
}

/// How one system serves the deployment: where each phase runs and what
/// memory it has. Built from the spec and plan; the mechanisms the
/// comparisons rest on (PD duplicating experts, TP replicating KV heads)
/// are visible here and tested.
#[derive(Clone, Debug, PartialEq)]
pub struct Deployment {
    pub system: System,
    /// A short description, e.g. `1P3D4E q=66` or `1P1D × DP4EP4`.
    pub label: String,
    pub phases: Phases,
    /// Copies of the routed experts the cluster holds.
    pub expert_copies: u32,
    /// KV tokens all decode groups hold together.
    pub decode_kv_tokens: f64,
}

/// Prompt tokens a DP rank's iteration takes in the chunked-prefill
/// baseline. ExpertPlex Figs. 7–10 label SGLang-ChunkedPrefill Chunk=2048
/// on DP8EP8 (MiniMax-M2) and 4096 on DP16EP16 (GLM-5); read as
/// `--chunked-prefill-size` (our reading: the label is the flag's value),
/// which SGLang divides by the DP size under DP attention (`server_args`:
/// "DP attention is enabled. The chunked prefill size is adjusted to …"),
/// each rank takes 256 in both settings. (2048 a rank would split no
/// ShareGPT prompt, which is at most 1024 tokens, and chunked prefill would
/// serve as colocated does; the paper measured it at half colocated's
/// goodput.)
pub const CHUNK_PER_RANK: f64 = 256.0;

/// Everything the systems share for one deployment.
pub struct Bench<'a> {
    pub spec: &'a Spec,
    pub plan: &'a Plan,
    pub env: Env,
    /// ExpertPlex's layout: the plan's search, or one given for a plan
    /// whose strategy did not run it ([`Bench::with_search`]).
    pub search: Option<SearchResult>,
    /// Tokens one request may hold: the KV of one PD decode GPU where PD
    /// can run here (ExpertPlex §7.1 caps sampled lengths at PD's KV
    /// capacity so every system serves the same requests); `None` otherwise.
    pub length_cap: Option<f64>,
}

impl<'a> Bench<'a> {
    /// Fails when the plan's cost model (a fitted profile, typically) gives
    /// negative or non-finite latencies over the batch sizes serving reaches.
    pub fn new(spec: &'a Spec, plan: &'a Plan) -> Result<Bench<'a>, String> {
        let cm = &plan.cost;
        cm.check_latencies()?;
        let d = spec.deploys.first().ok_or("the bundle's spec holds no deployment")?;
        let (m, c, t) = (spec.model(d.model), spec.cluster(d.cluster), spec.tile_set(d.tiles));
        let workspace = Workspace::of(m, plan.memory.modes.len() == 2).bytes();
        let env = Env::new(m, c, t, d, cm, workspace);
        let mut bench = Bench { spec, plan, env, search: plan.search.clone(), length_cap: None };
        bench.length_cap = bench.pd().ok().and_then(|pd| match pd.phases {
            Phases::Split { decode, .. } => Some(decode.kv_per_group),
            Phases::Unified { .. } => None,
        });
        Ok(bench)
    }

    /// Evaluates ExpertPlex on `search` (the layout search run for a plan
    /// whose strategy did not ask for one).
    pub fn with_search(mut self, search: SearchResult) -> Bench<'a> {
        self.search = Some(search);
        self
    }

    fn ep_shape(&self, kv_per_group: f64) -> Shape {
        let e = &self.env;
        Shape {
            groups: e.world,
            width: 1,
            moe: MoeSide::Ep {
                gpus: e.world,
                nodes: e.nodes,
                replicas: 1,
                local: f64::from(e.gpus_per_node) / f64::from(e.world),
                disaggregated: false,
            },
            kv_per_group,
            overlap: Overlaps::STANDARD,
        }
    }

    /// KV tokens per GPU left after `weights` bytes of weights.
    fn kv_after(&self, weights: f64, width: u32) -> f64 {
        self.env.kv_tokens(self.env.usable - weights - self.env.workspace, width)
    }

    /// The modeled decode iteration in TP and in EP at batches 1 to 2048
    /// (requests in flight, `context` cached tokens each,
    /// [`crate::policy::calibration_context`]): `t_high = auto`'s crossover
    /// where the serving engine has no device steps to measure.
    pub fn decode_costs(&self, context: u32) -> Result<Calibration, String> {
        let (tp, ep) = self.dual()?;
        Ok(self.shape_costs(&tp, &ep, context))
    }

    fn shape_costs(&self, tp: &Shape, ep: &Shape, context: u32) -> Calibration {
        let step = |shape: &Shape, b: usize| {
            let per = b as f64 / f64::from(shape.groups);
            let cached = per * f64::from(context);
            let loads: Vec<model::Load> = (0..shape.groups).map(|_| model::Load::decode(per, cached)).collect();
            self.env
                .iteration(&loads, shape.width, 1.0, shape.moe, model::Sms::all(self.env.cm.sms), 0.0, shape.overlap)
                .seconds
        };
        (0..12).map(|i| 1usize << i).map(|b| (b, step(tp, b), step(ep, b))).collect()
    }

    /// The dual-mode plan's shapes: (TP, EP), or why the plan has no TP mode.
    fn dual(&self) -> Result<(Shape, Shape), String> {
        let mem = &self.plan.memory;
        let tp = mem.kv.tp.as_ref().ok_or_else(|| {
            format!("the plan is EP-only: {}", mem.single_mode_reason.as_deref().unwrap_or("no TP mode"))
        })?;
        let g = mem.group;
        let tp_shape = Shape {
            groups: 1,
            width: g,
            moe: MoeSide::Tp { width: g },
            kv_per_group: tp.capacity_tokens as f64,
            overlap: Overlaps::STANDARD,
        };
        let ep_shape = self.ep_shape(mem.kv.ep.capacity_tokens as f64 / f64::from(g));
        Ok((tp_shape, ep_shape))
    }

    /// The deployment a system is evaluated in, or why it cannot run here.
    pub fn deployment(&self, system: System) -> Result<Deployment, String> {
        let e = &self.env;
        let colocated_kv = self.kv_after(e.weights_per_gpu(1, e.world), 1);
        // SGLang's default `--chunked-prefill-size` for the GPU's memory
        // (server_args: 2048 under 35 GiB, 8192 under 160 GiB, else 16384):
        // the serving engine Moebius modifies runs with it.
        let hbm_gib = self.spec.cluster(self.spec.deploys[0].cluster).gpu.hbm as f64 / f64::from(1u32 << 30);
        let sglang_chunk = if hbm_gib < 35.0 {
            2048.0
        } else if hbm_gib < 160.0 {
            8192.0
        } else {
            16384.0
        };
        let unified = |label: String, tp: Option<Shape>, ep: Option<Shape>, switch| {
            let kv = ep.or(tp).map_or(0.0, |s| f64::from(s.groups) * s.kv_per_group);
            // The ExpertPlex paper's SGLang baselines run with chunking off
            // (colocated) or at its chunk ([`CHUNK_PER_RANK`]); Moebius's, SGLang's default.
            let chunked_prefill = match system {
                System::StaticTp | System::StaticEp | System::Moebius => Some(sglang_chunk),
                System::ChunkedPrefill => Some(CHUNK_PER_RANK * f64::from(e.world)),
                _ => None,
            };
            Deployment {
                system,
                label,
                phases: Phases::Unified { chunked_prefill, tp, ep, switch },
                expert_copies: 1,
                decode_kv_tokens: kv,
            }
        };
        Ok(match system {
            System::Colocated => unified(format!("DP{0}EP{0}", e.world), None, Some(self.ep_shape(colocated_kv)), None),
            System::ChunkedPrefill => unified(
                format!(
                    "DP{0}EP{0} chunk {1} ({2} a rank)",
                    e.world,
                    CHUNK_PER_RANK * f64::from(e.world),
                    CHUNK_PER_RANK
                ),
                None,
                Some(self.ep_shape(colocated_kv)),
                None,
            ),
            System::StaticTp => {
                let (tp, _) = self.dual()?;
                unified(format!("TP{}", tp.width), Some(tp), None, None)
            }
            System::StaticEp => {
                let (_, ep) = self.dual()?;
                unified(format!("DP{0}EP{0} (dual-mode buffer)", e.world), None, Some(ep), None)
            }
            System::Moebius => {
                let (tp, ep) = self.dual()?;
                let switch = self.switching(&tp, &ep);
                let label =
                    format!("TP{}↔EP{} T_h={} T_l={}", tp.width, ep.groups, switch.policy.t_high, switch.policy.t_low);
                unified(label, Some(tp), Some(ep), Some(switch))
            }
            System::PdDisagg => self.pd()?,
            System::GreenContext => self.green(),
            System::ExpertPlex => self.expertplex()?,
        })
    }

    /// Moebius's policy from the spec; `t_high = auto` is set at the
    /// modeled TP/EP decode crossover ([`Bench::decode_costs`]), as the
    /// serving engine sets it at its measured one.
    fn switching(&self, tp: &Shape, ep: &Shape) -> Switching {
        let d = &self.spec.deploys[0];
        let mut policy = Policy::from_spec(&d.switch);
        if policy.calibrate {
            let context = crate::policy::calibration_context(&d.workload);
            policy = policy.with_t_high(crossover(&self.shape_costs(tp, ep, context)), d.switch.t_low);
        }
        let mem = &self.plan.memory;
        let weight_seconds = mem.reshard.as_ref().map_or(0.0, |r| self.env.cm.reshard_seconds(&r.ep_to_tp, mem));
        Switching { policy, start: Mode::Tp, weight_seconds }
    }

    /// Instance-level PD: the minimal unit is the fewest GPUs (a power of
    /// two) that hold a whole model replica; half the units prefill
    /// (`Env::pd_unit`, which the layout pass realizes for `pd-disagg`).
    fn pd(&self) -> Result<Deployment, String> {
        let e = &self.env;
        let unit = e.pd_unit().map_err(|unit| {
            format!(
                "a whole-model instance needs {unit} GPUs; {} GPUs cannot hold one prefill and one decode instance",
                e.world
            )
        })?;
        let instances = e.world / unit;
        let (np, nd) = (instances / 2, instances - instances / 2);
        let local = (f64::from(e.gpus_per_node) / f64::from(unit)).min(1.0);
        let side = |n: u32, kv: f64| Shape {
            groups: n * unit,
            width: 1,
            moe: MoeSide::Ep {
                gpus: unit,
                nodes: unit.div_ceil(e.gpus_per_node),
                replicas: n,
                local,
                disaggregated: false,
            },
            kv_per_group: kv,
            overlap: Overlaps::STANDARD,
        };
        // A plan that realizes PD (`strategy = pd-disagg`) is these
        // instances; its decode GPUs hold the compiled memory plan's KV pool.
        let kv = match self.plan.roles.as_ref().filter(|r| !r.moe_servers()) {
            Some(r) if r.ep_groups.first().map(Vec::len) == Some(unit as usize) => {
                let kv = &self.plan.memory.kv;
                (kv.ep.pages * u64::from(kv.page_tokens)) as f64
            }
            Some(_) => return Err("the plan's PD instances are not the simulator's".into()),
            None => self.kv_after(e.weights_per_gpu(1, unit), 1),
        };
        Ok(Deployment {
            system: System::PdDisagg,
            label: format!("{np}P{nd}D × DP{unit}EP{unit}"),
            phases: Phases::Split {
                prefill: side(np, f64::INFINITY),
                decode: side(nd, kv),
                sharing: Sharing::None,
                kv_transfer: true,
            },
            expert_copies: instances,
            decode_kv_tokens: f64::from(nd * unit) * kv,
        })
    }

    /// SGLang-PDMux (§7.1): PD-Multiplexing on Green Contexts
    /// ([`loops::PdMux`], SGLang's defaults), tensor-parallel attention (its
    /// implementation supports no other) in one group per node, EP experts
    /// over every GPU. (The paper ran GLM-5's baselines on 16 of the 24 GPUs,
    /// PDMux as TP16EP16; that is not modeled: README, "Simulate serving".)
    fn green(&self) -> Deployment {
        let e = &self.env;
        let w = e.gpus_per_node;
        let kv = self.kv_after(e.weights_per_gpu(w, e.world), w);
        let shape = |kv| Shape {
            groups: e.nodes,
            width: w,
            moe: MoeSide::Ep {
                gpus: e.world,
                nodes: e.nodes,
                replicas: 1,
                local: f64::from(e.gpus_per_node) / f64::from(e.world),
                disaggregated: false,
            },
            kv_per_group: kv,
            overlap: Overlaps::STANDARD,
        };
        let d = &self.spec.deploys[0];
        let mux = loops::PdMux::sglang(e.cm.sms, self.spec.cluster(d.cluster).gpu.arch);
        let splits = mux.splits();
        let range = match (splits.first(), splits.last()) {
            (Some(a), Some(b)) => format!("{}/{}–{}/{} SMs", a.0, a.1, b.0, b.1),
            _ => "no splits".into(),
        };
        Deployment {
            system: System::GreenContext,
            label: format!("TP{w}EP{} PDMux {range}", e.world),
            phases: Phases::Split {
                prefill: shape(f64::INFINITY),
                decode: shape(kv),
                sharing: Sharing::PdMux(mux),
                kv_transfer: false,
            },
            expert_copies: 1,
            decode_kv_tokens: f64::from(e.nodes) * kv,
        }
    }

    /// Virtual lanes of the deployment's scale-out link (1 without one).
    fn virtual_lanes(&self) -> u32 {
        let d = &self.spec.deploys[0];
        self.spec.cluster(d.cluster).scale_out.as_ref().map_or(1, |o| o.virtual_lanes)
    }

    /// The layout search's best ExpertPlex layout (Algorithm 1). A plan
    /// that realizes it (`plan.roles`) is that layout; its decode servers
    /// then hold the compiled memory plan's KV pool, not a modeled one.
    fn expertplex(&self) -> Result<Deployment, String> {
        let e = &self.env;
        let search = self.search.as_ref().ok_or(
            "the plan holds no layout search (its strategy does not ask for one); give one with `Bench::with_search`",
        )?;
        // A plan that realizes a layout (`plan.roles`) is evaluated as
        // compiled; otherwise the search's best, tensor-parallel attention included.
        // (A PD plan `auto` chose holds roles without MoE servers: it realizes no ExpertPlex layout.)
        let roles = self.plan.roles.as_ref().filter(|r| r.moe_servers());
        let best = match roles {
            Some(_) => search.realizable(),
            None => search.best(),
        }
        .ok_or("the layout search found no layout meeting both SLOs")?;
        let moe = best.moe_side();
        let x_star = expected_x_moe(
            f64::from(best.decode_batch) * e.top_k,
            e.experts,
            e.experts / f64::from(best.moe_gpus),
            f64::from(e.cm.m_t_decode),
        );
        let (pw, dw) = (best.prefill_width.max(1), best.decode_width.max(1));
        // KV tokens one decode group holds.
        let kv = match roles {
            Some(r) if r.per_node == best.per_node && r.q == best.q && r.overlap == best.overlap => {
                let kv = &self.plan.memory.kv;
                (kv.ep.pages * u64::from(kv.page_tokens)) as f64
            }
            Some(_) => return Err("the plan's roles are not the layout search's best realizable layout".into()),
            None => self.kv_after(e.nonrouted / f64::from(dw), dw),
        };
        Ok(Deployment {
            system: System::ExpertPlex,
            label: best.label(),
            phases: Phases::Split {
                prefill: Shape {
                    groups: best.prefill_gpus / pw,
                    width: pw,
                    moe,
                    kv_per_group: f64::INFINITY,
                    overlap: best.overlap,
                },
                decode: Shape {
                    groups: best.decode_gpus / dw,
                    width: dw,
                    moe,
                    kv_per_group: kv,
                    overlap: best.overlap,
                },
                sharing: Sharing::Apk {
                    q: best.q,
                    x_star,
                    q_max: moeforge_plan::cost::q_max(e.cm.sms, e.cluster),
                    lanes: self.virtual_lanes() >= 2,
                    shared: moeforge_plan::search::prefill_shared_scale_out(&best.per_node),
                },
                kv_transfer: true,
            },
            expert_copies: 1,
            decode_kv_tokens: f64::from(best.decode_gpus / dw) * kv,
        })
    }

    /// Serves `reqs` with one deployment.
    pub fn simulate(&self, dep: &Deployment, reqs: &[Req]) -> Vec<Outcome> {
        self.simulate_traced(dep, reqs).outcomes
    }

    /// Serves `reqs` and also returns when each mode switch completed and
    /// how many times a request was retracted to make KV room.
    pub fn simulate_traced(&self, dep: &Deployment, reqs: &[Req]) -> Trace {
        let reqs = self.capped(reqs);
        match &dep.phases {
            Phases::Unified { chunked_prefill, tp, ep, switch } => {
                let served = loops::unified(&self.env, *chunked_prefill, (*tp, *ep), switch.as_ref(), &reqs);
                Trace { outcomes: served.out, switches: served.switches, retractions: served.retractions }
            }
            Phases::Split { prefill, decode, sharing, kv_transfer } => Trace {
                outcomes: loops::split(&self.env, prefill, decode, *sharing, *kv_transfer, &reqs),
                switches: Vec::new(),
                retractions: 0,
            },
        }
    }

    /// Requests with their lengths capped at [`Bench::length_cap`]: the
    /// prompt gives way first, keeping at least one token and the outputs.
    fn capped(&self, reqs: &[Req]) -> Vec<Req> {
        let Some(cap) = self.length_cap else { return reqs.to_vec() };
        reqs.iter()
            .map(|r| {
                let mut r = *r;
                if r.reserve() > cap {
                    let output = r.output.min((cap * 0.5) as u32).max(2);
                    r.input = ((cap - f64::from(output)).floor() as u32).max(1);
                    r.output = output;
                }
                r
            })
            .collect()
    }
}
