//! The checker: files → [`Spec`], with every problem collected.
//!
//! 1. Load the root files and, depth first, every file they `use` (relative to
//!    the using file); a file reached twice is read once, a cycle is E0003.
//! 2. Parse each file; lower each block (`lower.rs`).
//! 3. Resolve names (duplicates E0102, unknown references E0101).
//! 4. Cross-block checks: model shape, tiles against the deploy's GPU and
//!    dtype, weights against the cluster's HBM, switch thresholds.
//!
//! It does not plan: how experts are placed or which layout is chosen is the
//! codegen crate's job.

use crate::diag::{Code, Diagnostic, Diagnostics};
use crate::fields::SpanMap;
use crate::lower::{self, DeployAst};
use crate::source::{normalize, FileId, Loader, SourceMap, Span};
use crate::spec::*;
use crate::syntax::{self, Block};
use crate::units::{human, Dim};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Spans of one block: its name and every field read, by dotted path
/// (`"moe.top_k"`, `"prefill.gate_up.block_m"`).
#[derive(Clone, Debug, Default)]
pub struct BlockSpans {
    pub name: Option<Span>,
    pub fields: SpanMap,
}

impl BlockSpans {
    /// The span of a field the block writes, if it does (no fallback).
    pub fn field(&self, path: &str) -> Option<Span> {
        self.fields.get(&format!(".{path}")).or(self.fields.get(path)).copied()
    }

    /// The span of a field, falling back to the block's name.
    pub fn get(&self, path: &str) -> Option<Span> {
        self.fields.get(&format!(".{path}")).or(self.fields.get(path)).copied().or(self.name)
    }
}

/// Side table of spans, indexed like the [`Spec`]'s arenas.
#[derive(Clone, Debug, Default)]
pub struct SpanTable {
    pub models: Vec<BlockSpans>,
    pub clusters: Vec<BlockSpans>,
    pub tiles: Vec<BlockSpans>,
    pub deploys: Vec<BlockSpans>,
}

/// A successful check: the spec, its sources and spans (for later stages'
/// diagnostics), and the warnings of every block.
#[derive(Clone, Debug)]
pub struct Checked {
    pub spec: Spec,
    pub sources: SourceMap,
    pub spans: SpanTable,
    pub warnings: Vec<(BlockRef, Diagnostic)>,
}

/// A block of a [`Spec`], for attributing warnings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockRef {
    Model(ModelId),
    Cluster(ClusterId),
    Tiles(TilesId),
    Deploy(DeployId),
}

/// So that APIs taking a checked spec also take what derefs to one
/// (`moeforge::EmbeddedSpec`).
impl AsRef<Checked> for Checked {
    fn as_ref(&self) -> &Checked {
        self
    }
}

impl Checked {
    /// Every warning of the checked files.
    pub fn all_warnings(&self) -> Diagnostics {
        Diagnostics(self.warnings.iter().map(|(_, d)| d.clone()).collect())
    }

    /// The warnings of the blocks deployment `id` uses.
    pub fn warnings_for(&self, id: DeployId) -> Diagnostics {
        let d = self.spec.deploy(id);
        let mine = |b: &BlockRef| match *b {
            BlockRef::Model(m) => m == d.model,
            BlockRef::Cluster(c) => c == d.cluster,
            BlockRef::Tiles(t) => t == d.tiles,
            BlockRef::Deploy(x) => x == id,
        };
        Diagnostics(self.warnings.iter().filter(|(b, _)| mine(b)).map(|(_, d)| d.clone()).collect())
    }
}

/// Fields that parse and check but that nothing reads yet (the next issues
/// wire them up): each gets a located warning where a block writes it.
fn warnings(spec: &Spec, spans: &SpanTable) -> Vec<(BlockRef, Diagnostic)> {
    let mut out = Vec::new();
    let mut warn = |b: BlockRef, s: Option<Span>, msg: String, help: &str| {
        if let Some(span) = s {
            out.push((b, Diagnostic::warning(Code::NoEffect, msg).at(span, "no effect yet").help(help.to_string())));
        }
    };
    for (i, t) in spec.tiles.iter().enumerate() {
        for phase in ["prefill", "decode"] {
            warn(
                BlockRef::Tiles(TilesId(i as u32)),
                spans.tiles.get(i).and_then(|s| s.field(&format!("{phase}.layout"))),
                format!("`{phase}.layout` of `{}` has no effect yet: the APK lays prefill rows out contiguously and decode rows masked", t.name),
                "remove it, or keep it for the kernels that will read it",
            );
        }
    }
    out
}

/// A failed check: the diagnostics and the sources they point into.
#[derive(Clone, Debug)]
pub struct Failed {
    pub sources: SourceMap,
    pub diagnostics: Diagnostics,
}

impl Failed {
    pub fn render(&self, color: bool) -> String {
        self.diagnostics.render(&self.sources, color)
    }
}

/// Checks the given root files and everything they `use`.
pub fn check_paths(roots: &[PathBuf], loader: &dyn Loader) -> Result<Checked, Failed> {
    let mut cx = Loading {
        loader,
        sources: SourceMap::default(),
        diags: Diagnostics::default(),
        loaded: BTreeMap::new(),
        stack: vec![],
        files: vec![],
    };
    for root in roots {
        cx.load(&normalize(root), None);
    }
    let Loading { sources, mut diags, files, .. } = cx;
    let (spec, spans) = build(&files, &mut diags);
    if diags.is_empty() {
        let warnings = warnings(&spec, &spans);
        Ok(Checked { spec, sources, spans, warnings })
    } else {
        Err(Failed { sources, diagnostics: diags })
    }
}

/// Checks one in-memory file (which may `use` nothing).
pub fn check_str(name: &str, text: &str) -> Result<Checked, Failed> {
    let loader = crate::source::MemLoader::new([(name, text)]);
    check_paths(&[PathBuf::from(name)], &loader)
}

struct Loading<'l> {
    loader: &'l dyn Loader,
    sources: SourceMap,
    diags: Diagnostics,
    loaded: BTreeMap<PathBuf, FileId>,
    /// Files being loaded, innermost last, with the `use` span that opened each.
    stack: Vec<PathBuf>,
    /// Parsed files in dependency order (a file after everything it uses).
    files: Vec<syntax::File>,
}

impl Loading<'_> {
    fn load(&mut self, path: &Path, used_at: Option<Span>) {
        if self.stack.iter().any(|p| p == path) {
            let chain: Vec<String> =
                self.stack.iter().chain([&path.to_path_buf()]).map(|p| p.display().to_string()).collect();
            let mut d = Diagnostic::new(Code::CircularUse, format!("circular `use`: {}", chain.join(" → ")));
            if let Some(s) = used_at {
                d = d.at(s, "this `use` closes the cycle");
            }
            self.diags.push(d.help("move the shared blocks into a file that both can `use`"));
            return;
        }
        if self.loaded.contains_key(path) {
            return;
        }
        let text = match self.loader.load(path) {
            Ok(t) => t,
            Err(e) => {
                let mut d = Diagnostic::new(Code::UseNotFound, format!("cannot read `{}`: {e}", path.display()));
                if let Some(s) = used_at {
                    d = d.at(s, "used here");
                }
                self.diags.push(d.help("`use` paths are relative to the file that contains them"));
                return;
            }
        };
        let id = self.sources.add(path.display().to_string(), text);
        self.loaded.insert(path.to_path_buf(), id);
        let parsed = match syntax::parse(id, self.sources.text(id)) {
            Ok(f) => f,
            Err(d) => {
                self.diags.push(d);
                return;
            }
        };
        self.stack.push(path.to_path_buf());
        let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
        for u in &parsed.uses {
            if u.path.is_empty() {
                self.diags.push(
                    Diagnostic::new(Code::UseNotFound, "empty `use` path")
                        .at(u.span, "empty path")
                        .help("write `use \"other.moe\"`"),
                );
                continue;
            }
            self.load(&normalize(&dir.join(&u.path)), Some(u.span));
        }
        self.stack.pop();
        self.files.push(parsed);
    }
}

/// Names declared so far, per block kind, with the span of the first declaration.
#[derive(Default)]
struct Names {
    models: BTreeMap<String, (u32, Span)>,
    clusters: BTreeMap<String, (u32, Span)>,
    tiles: BTreeMap<String, (u32, Span)>,
    deploys: BTreeMap<String, (u32, Span)>,
}

fn build(files: &[syntax::File], diags: &mut Diagnostics) -> (Spec, SpanTable) {
    let mut spec = Spec::default();
    let mut spans = SpanTable::default();
    let mut names = Names::default();
    let mut deploys: Vec<(DeployAst, BlockSpans)> = Vec::new();
    for file in files {
        for b in &file.blocks {
            lower_top(b, &mut spec, &mut spans, &mut names, &mut deploys, diags);
        }
    }
    for (ast, bs) in deploys {
        if let Some(d) = resolve_deploy(ast, &names, diags) {
            spec.deploys.push(d);
            spans.deploys.push(bs);
        }
    }
    for (i, m) in spec.models.iter().enumerate() {
        check_model(m, &spans.models[i], diags);
    }
    for (i, d) in spec.deploys.iter().enumerate() {
        check_deploy(&spec, d, &spans, &spans.deploys[i], diags);
    }
    (spec, spans)
}

fn lower_top(
    b: &Block,
    spec: &mut Spec,
    spans: &mut SpanTable,
    names: &mut Names,
    deploys: &mut Vec<(DeployAst, BlockSpans)>,
    diags: &mut Diagnostics,
) {
    const KINDS: &[&str] = &["model", "cluster", "tiles", "deploy"];
    let kind = b.kind.text.as_str();
    if !KINDS.contains(&kind) {
        let mut d = Diagnostic::new(Code::UnknownBlockKind, format!("unknown block kind `{kind}`"))
            .at(b.kind.span, "not a block kind");
        d = match crate::fields::suggest(kind, KINDS) {
            Some(s) => d.help(format!("did you mean `{s}`? (a file holds model, cluster, tiles and deploy blocks)")),
            None => d.help("a file holds model, cluster, tiles and deploy blocks"),
        };
        diags.push(d);
        return;
    }
    let Some(name) = &b.name else {
        diags.push(
            Diagnostic::new(Code::BlockName, format!("`{kind}` block needs a name"))
                .at(b.kind.span, "name missing after this")
                .help(format!("write `{kind} NAME {{ … }}`")),
        );
        return;
    };
    let table = match kind {
        "model" => &mut names.models,
        "cluster" => &mut names.clusters,
        "tiles" => &mut names.tiles,
        _ => &mut names.deploys,
    };
    if let Some((_, first)) = table.get(&name.text) {
        diags.push(
            Diagnostic::new(Code::DuplicateName, format!("{kind} `{}` is declared twice", name.text))
                .at(name.span, "second declaration")
                .also(*first, "first declared here")
                .help(format!("rename one of them; every {kind} needs its own name")),
        );
        return;
    }
    let mut bs = BlockSpans { name: Some(name.span), fields: SpanMap::new() };
    let index = match kind {
        "model" => lower::model(b, &name.text, diags, &mut bs.fields).map(|m| {
            spec.models.push(m);
            spans.models.push(bs);
            spec.models.len() - 1
        }),
        "cluster" => lower::cluster(b, &name.text, diags, &mut bs.fields).map(|c| {
            spec.clusters.push(c);
            spans.clusters.push(bs);
            spec.clusters.len() - 1
        }),
        "tiles" => lower::tiles(b, &name.text, diags, &mut bs.fields).map(|t| {
            spec.tiles.push(t);
            spans.tiles.push(bs);
            spec.tiles.len() - 1
        }),
        _ => {
            let ast = lower::deploy(b, &name.text, diags, &mut bs.fields);
            deploys.push((ast, bs));
            Some(deploys.len() - 1)
        }
    };
    // A block that failed to lower still claims its name, so references to
    // it do not cascade into "unknown name" errors; u32::MAX marks it.
    let idx = index.map_or(u32::MAX, |i| i as u32);
    table.insert(name.text.clone(), (idx, name.span));
}

fn resolve_deploy(ast: DeployAst, names: &Names, diags: &mut Diagnostics) -> Option<Deploy> {
    let model = resolve(&ast.model, &names.models, "model", diags);
    let cluster = resolve(&ast.cluster, &names.clusters, "cluster", diags);
    let tiles = resolve(&ast.tiles, &names.tiles, "tiles", diags);
    let mut d = ast.rest?;
    d.model = ModelId(model?);
    d.cluster = ClusterId(cluster?);
    d.tiles = TilesId(tiles?);
    Some(d)
}

fn resolve(
    r: &Option<crate::syntax::Ident>,
    table: &BTreeMap<String, (u32, Span)>,
    kind: &str,
    diags: &mut Diagnostics,
) -> Option<u32> {
    let r = r.as_ref()?;
    match table.get(&r.text) {
        Some((idx, _)) if *idx != u32::MAX => Some(*idx),
        Some(_) => None, // declared but invalid: already reported
        None => {
            let known: Vec<&str> = table.keys().map(String::as_str).collect();
            let mut d = Diagnostic::new(Code::UnknownName, format!("no {kind} named `{}`", r.text))
                .at(r.span, format!("unknown {kind}"));
            d = match crate::fields::suggest(&r.text, &known) {
                Some(s) => d.help(format!("did you mean `{s}`?")),
                None if known.is_empty() => {
                    d.help(format!("declare `{kind} {} {{ … }}` or `use` the file that does", r.text))
                }
                None => d.help(format!("known {kind} names: {}", known.join(", "))),
            };
            diags.push(d);
            None
        }
    }
}

fn kib(bytes: u64) -> String {
    let k = bytes as f64 / 1024.0;
    if k.fract() == 0.0 {
        format!("{k}KiB")
    } else {
        format!("{k:.1}KiB")
    }
}

fn at(spans: &BlockSpans, path: &str) -> Span {
    spans.get(path).unwrap_or(Span::new(FileId(0), 0, 0))
}

fn check_model(m: &Model, spans: &BlockSpans, diags: &mut Diagnostics) {
    let moe = &m.moe;
    if moe.top_k > moe.experts {
        diags.push(
            Diagnostic::new(
                Code::TopKExceedsExperts,
                format!("top_k = {} exceeds the {} routed experts", moe.top_k, moe.experts),
            )
            .at(at(spans, "moe.top_k"), "larger than `experts`")
            .also(at(spans, "moe.experts"), "experts declared here")
            .help("a token is routed to top_k distinct experts, so top_k ≤ experts"),
        );
    }
    if let Routing::SigmoidGrouped { groups, top_groups, .. } = moe.routing {
        if !moe.experts.is_multiple_of(groups) {
            diags.push(
                Diagnostic::new(
                    Code::Inconsistent,
                    format!("{} experts do not split into {groups} equal groups", moe.experts),
                )
                .at(at(spans, "moe.routing.groups"), "must divide `experts`")
                .help("grouped routing needs experts divisible by groups (DeepSeek-V3: 256 experts, 8 groups)"),
            );
        } else if top_groups > groups {
            diags.push(
                Diagnostic::new(Code::Inconsistent, format!("top_groups = {top_groups} exceeds groups = {groups}"))
                    .at(at(spans, "moe.routing.top_groups"), "larger than `groups`")
                    .help("top_groups selects among the groups, so top_groups ≤ groups"),
            );
        } else if moe.top_k > top_groups * (moe.experts / groups) {
            diags.push(
                Diagnostic::new(
                    Code::TopKExceedsExperts,
                    format!(
                        "top_k = {} exceeds the {} experts in the {top_groups} selected groups",
                        moe.top_k,
                        top_groups * (moe.experts / groups)
                    ),
                )
                .at(at(spans, "moe.top_k"), "too many for the selected groups")
                .help("raise `top_groups` or lower `top_k`"),
            );
        }
    }
    match m.attention {
        Attention::Gqa { heads, kv_heads, head_dim, rope_dim, .. } => {
            if heads % kv_heads != 0 {
                diags.push(
                    Diagnostic::new(
                        Code::HeadsNotDivisible,
                        format!("{heads} attention heads are not divisible by {kv_heads} KV heads"),
                    )
                    .at(at(spans, "attention.kv_heads"), "must divide `heads`")
                    .also(at(spans, "attention.heads"), "heads declared here")
                    .help("in GQA every KV head serves heads / kv_heads query heads"),
                );
            }
            if rope_dim > head_dim || rope_dim % 2 != 0 {
                diags.push(
                    Diagnostic::new(
                        Code::Inconsistent,
                        format!("rope_dim = {rope_dim} must be even and at most head_dim = {head_dim}"),
                    )
                    .at(at(spans, "attention.rope_dim"), "invalid rotary width")
                    .help("RoPE rotates pairs of dimensions inside one head"),
                );
            }
        }
        Attention::Mla { qk_rope, indexer, .. } => {
            if qk_rope % 2 != 0 {
                diags.push(
                    Diagnostic::new(Code::Inconsistent, format!("qk_rope = {qk_rope} must be even"))
                        .at(at(spans, "attention.qk_rope"), "odd rotary width")
                        .help("RoPE rotates pairs of dimensions"),
                );
            }
            if let Some(ix) = indexer.filter(|ix| ix.head_dim < qk_rope) {
                diags.push(
                    Diagnostic::new(
                        Code::Inconsistent,
                        format!("index_head_dim = {} is below qk_rope = {qk_rope}", ix.head_dim),
                    )
                    .at(at(spans, "attention.index_head_dim"), "narrower than the rotary width")
                    .also(at(spans, "attention.qk_rope"), "rotary width declared here")
                    .help("the DSA indexer applies RoPE to the first qk_rope dims of its heads"),
                );
            }
        }
    }
    if let Some(d) = m.dense {
        if d.layers >= m.layers {
            diags.push(
                Diagnostic::new(
                    Code::Inconsistent,
                    format!("{} dense layers leave no MoE layer among {}", d.layers, m.layers),
                )
                .at(at(spans, "dense"), "too many dense layers")
                .help("dense.layers counts the leading dense layers and must be below `layers`"),
            );
        }
    }
}

/// Static shared memory a kernel may declare (CUDA's 48 KiB without opt-in).
pub const ATTENTION_STATIC_SMEM: u64 = 48 * 1024;

fn check_deploy(spec: &Spec, d: &Deploy, spans: &SpanTable, ds: &BlockSpans, diags: &mut Diagnostics) {
    let model = spec.model(d.model);
    let cluster = spec.cluster(d.cluster);
    let tiles = spec.tile_set(d.tiles);
    let ts = &spans.tiles[d.tiles.index()];
    let gpu = &cluster.gpu;
    let fp8 = |d: DType| if d == DType::Fp8E4m3 { DType::Fp8E4m3 } else { DType::Bf16 };
    // Every GEMM tile with the dtype its weights are read in: the experts'
    // per phase and GEMM, and the dense GEMMs' when the set has them.
    let mut gemm_tiles: Vec<(String, Tile, DType)> = Vec::new();
    for (phase, pt) in [("prefill", &tiles.prefill), ("decode", &tiles.decode)] {
        for (op, t) in [("gate_up", &pt.gate_up), ("down", &pt.down)] {
            gemm_tiles.push((format!("{phase}.{op}"), *t, fp8(model.dtype.experts)));
        }
    }
    if let Some(dt) = &tiles.dense {
        gemm_tiles.push(("dense".into(), dt.tile, fp8(model.dtype.weights)));
        let mma = gpu.arch.mma_shape(fp8(model.dtype.weights));
        if dt.decode_block_m % mma[0] != 0 {
            diags.push(
                Diagnostic::new(
                    Code::TileNotMmaMultiple,
                    format!(
                        "`dense.decode_block_m` = {} is not a multiple of {}, the {} MMA m",
                        dt.decode_block_m,
                        mma[0],
                        gpu.arch.name()
                    ),
                )
                .at(at(ts, "dense.decode_block_m"), format!("not a multiple of {}", mma[0]))
                .also(at(ds, "tiles"), "used by this deployment")
                .help(format!("use a multiple of {}", mma[0])),
            );
        }
    }
    for (path, t, input) in &gemm_tiles {
        let (path, t, input) = (path.as_str(), t, *input);
        let mma = gpu.arch.mma_shape(input);
        {
            let smem = t.smem_bytes(input);
            if smem > gpu.smem_per_block {
                diags.push(
                    Diagnostic::new(
                        Code::TileSmemExceeded,
                        format!(
                            "tile `{path}` needs {} of shared memory; `{}` allows {} per block",
                            kib(smem),
                            gpu.name,
                            kib(gpu.smem_per_block)
                        ),
                    )
                    .at(at(ts, &format!("{path}.stages")), format!("{} stages × {} + epilogue", t.stages, kib(u64::from((t.block_m + t.block_n) * t.block_k) * if input == DType::Bf16 { 2 } else { 1 })))
                    .also(at(ds, "tiles"), "used by this deployment")
                    .help("lower `stages` or the block sizes: smem = stages × (block_m + block_n) × block_k × bytes + block_m × block_n × 2"),
                );
            }
            for (dim, v, want) in
                [("block_m", t.block_m, mma[0]), ("block_n", t.block_n, mma[1]), ("block_k", t.block_k, mma[2])]
            {
                if v % want != 0 {
                    diags.push(
                        Diagnostic::new(
                            Code::TileNotMmaMultiple,
                            format!(
                                "`{path}.{dim}` = {v} is not a multiple of {want}, the {} MMA {} for {}",
                                gpu.arch.name(),
                                &dim[6..],
                                input.name()
                            ),
                        )
                        .at(at(ts, &format!("{path}.{dim}")), format!("not a multiple of {want}"))
                        .also(at(ds, "tiles"), "used by this deployment")
                        .help(format!("use a multiple of {want} (MMA shape m{}n{}k{})", mma[0], mma[1], mma[2])),
                    );
                }
            }
            let [cx, cy] = t.cluster;
            let bad = if !gpu.arch.has_clusters() && (cx, cy) != (1, 1) {
                Some(format!("{} has no thread-block clusters", gpu.arch.name()))
            } else if cx * cy > 8 {
                Some(format!("{} CTAs per cluster exceed the portable limit of 8", cx * cy))
            } else if !(cx * cy).is_power_of_two() {
                Some("TMA multicast needs a power-of-two cluster size".to_string())
            } else {
                None
            };
            if let Some(why) = bad {
                diags.push(
                    Diagnostic::new(Code::TileCluster, format!("tile `{path}` has cluster [{cx}, {cy}]: {why}"))
                        .at(at(ts, &format!("{path}.cluster")), "unsupported cluster shape")
                        .help("use [1, 1] on sm_80; on sm_90a a power of two up to 8 CTAs"),
                );
            }
        }
    }
    if let (Some(a), Attention::Gqa { head_dim, .. }) = (&tiles.attention, model.attention) {
        // The prefill attention kernel: 16 query rows per warp (one MMA's m),
        // keys in steps of one MMA's k, K and Vᵀ tiles in static shared memory.
        for (dim, v) in [("block_q", a.block_q), ("block_kv", a.block_kv)] {
            if v % 16 != 0 {
                diags.push(
                    Diagnostic::new(
                        Code::TileNotMmaMultiple,
                        format!("`attention.{dim}` = {v} is not a multiple of 16, the bf16 MMA's m and k"),
                    )
                    .at(at(ts, &format!("attention.{dim}")), "not a multiple of 16")
                    .also(at(ds, "tiles"), "used by this deployment")
                    .help("use a multiple of 16 (mma.sync m16n8k16)"),
                );
            }
        }
        let smem = a.smem_bytes(head_dim);
        if smem > ATTENTION_STATIC_SMEM {
            diags.push(
                Diagnostic::new(
                    Code::TileSmemExceeded,
                    format!(
                        "`attention.block_kv` = {} needs {} of static shared memory for heads of {head_dim}; a kernel has {}",
                        a.block_kv,
                        kib(smem),
                        kib(ATTENTION_STATIC_SMEM)
                    ),
                )
                .at(at(ts, "attention.block_kv"), "K and Vᵀ tiles")
                .also(at(ds, "tiles"), "used by this deployment")
                .help("lower block_kv: smem = 2 × (block_kv × (head_dim + 8) + head_dim × (block_kv + 8)) bytes"),
            );
        }
    }
    let weights = model.weight_bytes();
    let hbm = cluster.gpu.hbm as f64 * f64::from(cluster.world_size());
    if weights as f64 > hbm {
        diags.push(
            Diagnostic::new(
                Code::WeightsDoNotFit,
                format!(
                    "`{}` has {} of weights, more than the {} of HBM in `{}` ({} GPUs × {})",
                    model.name,
                    human(weights as f64, Dim::Bytes),
                    human(hbm, Dim::Bytes),
                    cluster.name,
                    cluster.world_size(),
                    human(cluster.gpu.hbm as f64, Dim::Bytes)
                ),
            )
            .at(at(ds, "cluster"), "too small for this model")
            .also(at(ds, "model"), "this model")
            .help("use a cluster with more GPUs or nodes, or a lower-precision checkpoint"),
        );
    }
}
