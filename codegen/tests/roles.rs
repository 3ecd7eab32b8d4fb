//! ExpertPlex roles, realized: GLM-5 on 3×8 H800 with Zepp replicas (the
//! ExpertPlex paper's deployment) compiles into prefill, decode and MoE
//! servers with their own memory, the replicas only on MoE servers, and a
//! dispatch schedule; the validator catches a broken role plan.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use moeforge_codegen::plan_deployment;
use moeforge_dsl::{check_paths, FsLoader};
use moeforge_plan::memory::{BufferName, Mode, RegionKind};
use moeforge_plan::placement::{replicas_of, route, routing_stats, Topology};
use moeforge_plan::roles::Role;
use moeforge_plan::validate::check;
use moeforge_plan::{KernelParams, Plan};
use std::collections::BTreeSet;

fn glm5() -> Plan {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/glm-5-h800x24.moe");
    let c = check_paths(&[path], &FsLoader).unwrap();
    let id = c.spec.deploy_ids().next().unwrap();
    plan_deployment(&c, id).unwrap_or_else(|e| panic!("{e:?}")).plan().clone()
}

fn region(p: &Plan, kind: RegionKind) -> (usize, &moeforge_plan::memory::Region) {
    p.memory.regions.iter().enumerate().find(|(_, r)| r.kind == kind).unwrap()
}

#[test]
fn the_searched_layout_becomes_each_gpus_role() {
    let p = glm5();
    let roles = p.roles.as_ref().expect("strategy = expertplex realizes roles");
    let best = &p.search.as_ref().unwrap().ranked[0];
    assert!(best.data_parallel(), "the examples' best layouts run data-parallel attention");
    assert_eq!(roles.per_node, best.per_node);
    assert_eq!(roles.q, best.q);
    assert_eq!(roles.overlap, best.overlap);
    // Node by node, its MoE servers first, then prefill, then decode.
    for (n, &[moe, pre, dec]) in roles.per_node.iter().enumerate() {
        let node = &roles.gpus[n * 8..(n + 1) * 8];
        assert_eq!(node.iter().filter(|&&r| r == Role::Moe).count() as u32, moe);
        assert_eq!(node.iter().filter(|&&r| r == Role::Prefill).count() as u32, pre);
        assert_eq!(node.iter().filter(|&&r| r == Role::Decode).count() as u32, dec);
    }
    assert_eq!(roles.ranks(Role::Moe).len() as u32, best.moe_gpus);
    assert_eq!(p.layout.ep_size, best.moe_gpus);
    // The APK runs with the searched q, rounded up to whole CTA clusters.
    let apk = p
        .kernels
        .iter()
        .find_map(|k| match &k.params {
            KernelParams::Apk(a) if a.local_experts > 1 => Some(a.clone()),
            _ => None,
        })
        .unwrap();
    assert!(apk.q >= roles.q && apk.q < roles.q + apk.cluster_size, "APK q {} for searched {}", apk.q, roles.q);
    assert!(check(&p).is_empty(), "{:?}", check(&p));
}

#[test]
fn each_role_holds_its_own_regions_behind_a_shared_workspace() {
    let p = glm5();
    let roles = p.roles.as_ref().unwrap();
    let mem = &p.memory;
    // The workspace first, at the same offsets on every GPU.
    let mut at = 0;
    for kind in [RegionKind::Comm, RegionKind::Scratch, RegionKind::Requests] {
        let (_, r) = region(&p, kind);
        assert!(r.roles.is_empty(), "{kind:?} is every GPU's");
        assert_eq!(r.offset, at, "{kind:?}");
        at += r.bytes;
    }
    // Attention servers: replicated weights, attention, then the KV pool to the end.
    let (_, rep) = region(&p, RegionKind::Replicated);
    let (_, attn) = region(&p, RegionKind::AttentionEp);
    let (_, kv) = region(&p, RegionKind::KvPool);
    assert_eq!(rep.offset, at);
    assert_eq!(attn.offset, rep.offset + rep.bytes);
    assert_eq!(kv.offset, attn.offset + attn.bytes);
    assert_eq!(kv.offset + kv.bytes, mem.buffer_bytes);
    // MoE servers: the expert slots overlay the attention servers' regions.
    let (_, ex) = region(&p, RegionKind::Experts);
    assert_eq!(ex.roles, [Role::Moe]);
    assert_eq!(ex.offset, at);
    assert!(ex.offset + ex.bytes <= mem.buffer_bytes);
    // Its size, from the model's expert bytes (not the memory pass's
    // formula): every MoE layer's slots, plus fp8 block scales (~0.02%).
    let slots = u64::from(p.layout.max_experts_per_rank);
    let bare = u64::from(p.model.moe_layers) * slots * p.model.expert_bytes;
    assert!(ex.bytes >= bare && (ex.bytes as f64) < bare as f64 * 1.01, "{} vs {bare}", ex.bytes);
    // KV: only attention servers hold it.
    let a = roles.attention_ranks().len() as u64;
    assert_eq!(mem.kv.ep.capacity_tokens, a * mem.kv.ep.pages * u64::from(mem.kv.page_tokens));
    assert_eq!(mem.kv.ep.pages, kv.bytes / mem.kv.ep.page_bytes);
}

#[test]
fn replicas_live_only_on_moe_servers_and_routing_prefers_the_senders_node() {
    let p = glm5();
    let roles = p.roles.as_ref().unwrap();
    let pl = p.placement.as_ref().expect("the example asks for zepp");
    let slots = pl.slots_per_gpu();
    let experts = p.model.experts as usize;
    assert_eq!(slots * roles.ranks(Role::Moe).len(), experts + pl.redundant_experts as usize);
    let t = Topology { nodes: 3, gpus_per_node: 8 };
    let (mut local, mut expected) = (0.0, 0.0);
    for layer in &pl.replicas {
        for (g, held) in layer.iter().enumerate() {
            let distinct: BTreeSet<_> = held.iter().collect();
            match roles.gpus[g] {
                Role::Moe => assert_eq!((held.len(), distinct.len()), (slots, slots), "GPU {g}"),
                _ => assert!(held.is_empty(), "attention server {g} holds {held:?}"),
            }
        }
        let reps = replicas_of(layer, experts);
        assert!(reps.iter().all(|r| !r.is_empty()), "an expert has no replica");
        // Uniform demand from the attention servers only (4 on each node).
        let demand: Vec<Vec<f64>> =
            (0..24).map(|g| if roles.gpus[g].attends() { vec![10.0; experts] } else { vec![0.0; experts] }).collect();
        let r = route(pl.policy, layer, &demand, t, pl.slack);
        let moved: f64 = r.iter().flatten().flatten().map(|x| x.1).sum();
        let sent: f64 = demand.iter().flatten().sum();
        assert!((moved - sent).abs() < 1e-6 * sent, "rows not conserved: {moved} of {sent}");
        assert!(
            r.iter().flatten().flatten().all(|&(g, _)| roles.gpus[g] == Role::Moe),
            "a row went to an attention server"
        );
        local += routing_stats(&r, t).1;
        // Closed form: every node sends a third of each expert's rows, and
        // a node holding a replica serves its own third locally (a third is
        // within a replica's (1 + slack)/2 bound when there are two).
        let nodes_holding = |e: usize| reps[e].iter().map(|&g| g / 8).collect::<BTreeSet<_>>().len() as f64;
        expected += (0..experts).map(|e| nodes_holding(e) / 3.0).sum::<f64>() / experts as f64;
    }
    let n = pl.replicas.len() as f64;
    let (local, expected) = (local / n, expected / n);
    // Without replicas a third of the rows stay on the sender's node (4 of
    // the 12 MoE servers are on each node); each replica on another node
    // keeps that node's share of its expert local.
    assert!(local > 1.0 / 3.0, "node-local share {local:.4}");
    assert!((local - expected).abs() < 0.01, "node-local share {local:.4}, closed form {expected:.4}");
    eprintln!("GLM-5 roles with Zepp replicas: {slots} slots per MoE server, node-local share {local:.4} (closed form {expected:.4})");
}

#[test]
fn every_attention_rank_posts_into_its_own_rows_of_every_moe_rank() {
    let p = glm5();
    let roles = p.roles.as_ref().unwrap();
    let d = p.memory.buffer(Mode::Ep, BufferName::Dispatch).unwrap();
    let (attn, moe) = (roles.attention_ranks(), roles.ranks(Role::Moe));
    let pairs: BTreeSet<(u32, u32)> = roles.posts.iter().map(|x| (x.src, x.dst)).collect();
    assert_eq!(pairs.len(), attn.len() * moe.len());
    assert_eq!(roles.posts.len(), pairs.len());
    for &m in &moe {
        let mut rows: Vec<[u64; 2]> =
            roles.posts.iter().filter(|x| x.dst == m).map(|x| [x.first_row, x.first_row + x.rows]).collect();
        rows.sort_unstable();
        assert!(rows.windows(2).all(|w| w[0][1] <= w[1][0]), "overlap on {m}");
        assert!(rows.last().unwrap()[1] <= d.rows);
        // Decode's regions at the buffer's head, before any prefill server's.
        let end = |role: Role| roles.posts.iter().filter(move |x| x.dst == m && roles.gpus[x.src as usize] == role);
        let decode_end = end(Role::Decode).map(|x| x.first_row + x.rows).max().unwrap();
        assert!(end(Role::Prefill).all(|x| x.first_row >= decode_end), "MoE rank {m}: a prefill region first");
    }
    assert!(roles.posts.iter().all(|x| x.offset == d.offset + x.first_row * d.row_bytes));
    assert_eq!(roles.kv_handoff.page_bytes, p.memory.kv.ep.page_bytes);
    // A decode server's post holds one full decode step of it (⌈B_d / D⌉
    // rows: a token sends a MoE rank at most one row), so decode never
    // dispatches in rounds; the prefill servers share the rest evenly.
    let best = &p.search.as_ref().unwrap().ranked[0];
    let rows_of = |role: Role| {
        let r: BTreeSet<u64> =
            roles.posts.iter().filter(|x| roles.gpus[x.src as usize] == role).map(|x| x.rows).collect();
        assert_eq!(r.len(), 1, "{role:?} servers' posts differ: {r:?}");
        r.into_iter().next().unwrap()
    };
    let (pre, dec) = (rows_of(Role::Prefill), rows_of(Role::Decode));
    assert_eq!(dec, u64::from(best.decode_batch.div_ceil(best.decode_gpus)));
    let (np, nd) = (u64::from(best.prefill_gpus), u64::from(best.decode_gpus));
    assert_eq!(pre, (d.rows - nd * dec) / np);
    let held: u64 = roles.posts.iter().filter(|x| x.dst == moe[0]).map(|x| x.rows).sum();
    assert!(held <= d.rows && d.rows - held < np, "{held} of {}", d.rows);
    eprintln!("GLM-5 posts: {pre} rows per prefill server, {dec} per decode server, {held} of {} rows", d.rows);
}

/// Each post's path is §5's, checked pair by pair from the GPUs' roles and
/// nodes: NVLink inside a node; decode straight over RDMA on lane 0; prefill
/// relayed by a prefill server on the MoE rank's node where there is one
/// (the sender's local rank when that GPU is a prefill server), otherwise
/// straight over RDMA on lane 1 (H800's InfiniBand has two lanes). The
/// share of prefill pairs left on a link decode uses is the fraction the
/// simulator charges prefill's interference with
/// (`prefill_shared_scale_out`, counted from the per-node layout).
#[test]
fn posts_take_the_hierarchical_prefill_path_and_decode_the_high_priority_lane() {
    use moeforge_plan::roles::Path;
    use moeforge_plan::search::prefill_shared_scale_out;
    let p = glm5();
    let roles = p.roles.as_ref().unwrap();
    assert_eq!(roles.lanes, 2);
    let node = |r: u32| r / 8;
    let (mut relayed, mut direct, mut prefill_pairs) = (0, 0, 0);
    for x in &roles.posts {
        let src_role = roles.gpus[x.src as usize];
        let prefill_there: Vec<u32> =
            (node(x.dst) * 8..node(x.dst) * 8 + 8).filter(|&r| roles.gpus[r as usize] == Role::Prefill).collect();
        if src_role == Role::Prefill {
            prefill_pairs += 1;
        }
        match x.path {
            Path::Nvlink => assert_eq!(node(x.src), node(x.dst), "{x:?}"),
            Path::Rdma { lane } => {
                assert_ne!(node(x.src), node(x.dst), "{x:?}");
                match src_role {
                    Role::Decode => assert_eq!(lane, 0, "{x:?}"),
                    _ => {
                        assert_eq!(lane, 1, "{x:?}");
                        assert!(prefill_there.is_empty(), "{x:?}: its node has prefill servers {prefill_there:?}");
                        direct += 1;
                    }
                }
            }
            Path::Relay { via } => {
                assert_eq!(src_role, Role::Prefill, "{x:?}");
                assert!(prefill_there.contains(&via), "{x:?}: relay is not a prefill server on the MoE rank's node");
                if prefill_there.contains(&(node(x.dst) * 8 + x.src % 8)) {
                    assert_eq!(via % 8, x.src % 8, "{x:?}: the same local rank is a prefill server");
                }
                relayed += 1;
            }
        }
    }
    assert!(relayed > 0, "GLM-5's layout spreads prefill servers, so some prefill rows are relayed");
    let shared = f64::from(direct) / f64::from(prefill_pairs);
    assert!((shared - prefill_shared_scale_out(&roles.per_node)).abs() < 1e-12, "{shared} {:?}", roles.per_node);
    eprintln!(
        "{} posts: {relayed} relayed, {direct} prefill direct on lane 1, per node {:?}",
        roles.posts.len(),
        roles.per_node
    );
}

/// Each kind of broken role plan is a violation at the field that broke.
#[test]
fn the_validator_catches_a_broken_role_plan() {
    let p = glm5();
    let roles = p.roles.as_ref().unwrap();
    let attn = roles.attention_ranks()[0] as usize;
    let broken = |f: &dyn Fn(&mut Plan)| {
        let mut q = p.clone();
        f(&mut q);
        check(&q).into_iter().map(|v| v.to_string()).collect::<Vec<_>>()
    };
    let finds = |v: Vec<String>, what: &str| assert!(v.iter().any(|x| x.contains(what)), "{what} not in {v:?}");
    finds(broken(&|q| q.ranks[attn].experts = [0, 1]), &format!("ranks[{attn}].experts"));
    finds(
        broken(&|q| {
            let r = q.roles.as_mut().unwrap();
            r.posts[1].first_row = r.posts[0].first_row;
            r.posts[1].offset = r.posts[0].offset;
        }),
        "overlap",
    );
    let (ei, _) = region(&p, RegionKind::Experts);
    finds(broken(&|q| q.memory.regions[ei].roles.clear()), &format!("memory.regions[{ei}].roles"));
    let (ki, _) = region(&p, RegionKind::KvPool);
    finds(broken(&|q| q.memory.regions[ki].offset += 4096), "kv_pool");
    finds(broken(&|q| q.roles.as_mut().unwrap().gpus.swap(0, 7)), "roles.per_node");
    let cross = roles.posts.iter().position(|x| x.src / 8 != x.dst / 8).unwrap();
    finds(
        broken(&|q| q.roles.as_mut().unwrap().posts[cross].path = moeforge_plan::roles::Path::Nvlink),
        &format!("roles.posts[{cross}].path"),
    );
    finds(broken(&|q| q.roles.as_mut().unwrap().lanes = 3), "roles.lanes");
    // Uneven MoE servers per node (laid out consistently) cannot hold replicas.
    finds(
        broken(&|q| {
            let r = q.roles.as_mut().unwrap();
            r.per_node = vec![[5, 1, 2], [4, 1, 3], [3, 2, 3]];
            r.gpus = moeforge_plan::roles::Roles::lay_out(&r.per_node);
            r.ep_groups = vec![r.ranks(Role::Moe)];
        }),
        "replicas need the same number of MoE servers",
    );
    finds(
        broken(&|q| {
            let pl = q.placement.as_mut().unwrap();
            let e = pl.replicas[0][0][0];
            pl.replicas[0][attn] = vec![e];
        }),
        "placement.replicas[0]",
    );
}
