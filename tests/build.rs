//! `moeforge build`: the deployable binary runs with nothing beside it,
//! carries exactly the bundle `moeforge compile` writes, refuses a machine
//! that does not fit, and its launchers are sized from the cluster block.

#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

mod common;
use common::*;
use std::path::Path;
use std::process::Command;
use yaml_rust2::{Yaml, YamlLoader};

fn build(spec: &str, out: &Path) {
    let o = moeforge(&["build", spec, "-o", out.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(text(&o.stdout).contains("the bundle embedded"), "{}", text(&o.stdout));
}

fn request_tokens(stdout: &str) -> Vec<String> {
    stdout.lines().filter(|l| l.starts_with("request ")).map(str::to_string).collect()
}

#[test]
fn the_binary_is_self_contained_and_carries_the_compiled_bundle() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dep");
    build("examples/tiny-qwen3-cpu4.moe", &out);
    // Alone in a directory of its own, far from the repository.
    let alone = tmp.path().join("alone");
    std::fs::create_dir(&alone).unwrap();
    let bin = alone.join("tiny-qwen3-cpu4");
    std::fs::copy(out.join("bin/tiny-qwen3-cpu4"), &bin).unwrap();
    let weights = tmp.path().join("weights");
    let o = moeforge(
        &["init-weights", "examples/tiny-qwen3-cpu4.moe", "--seed", "7", "-o", weights.to_str().unwrap()],
        None,
    );
    assert!(o.status.success());

    let o = Command::new(&bin).arg("info").current_dir(&alone).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    assert!(
        text(&o.stdout).contains("deployment `tiny-qwen3-cpu4`") && text(&o.stdout).contains("fits the cpu backend")
    );

    // Its bundle is the one `moeforge compile` writes, byte for byte.
    let extracted = tmp.path().join("extracted");
    let o = Command::new(&bin).args(["extract", "-o", extracted.to_str().unwrap()]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let compiled = tmp.path().join("compiled");
    let o =
        moeforge(&["compile", "examples/tiny-qwen3-cpu4.moe", "-o", compiled.to_str().unwrap(), "--nvcc", "off"], None);
    assert!(o.status.success());
    assert_eq!(read_tree(&extracted), read_tree(&compiled));

    // And it runs it: the tokens `moeforge run` gives on that bundle.
    let args = ["--weights", weights.to_str().unwrap(), "--prompt", "1 2 3", "--prompt", "9 8 7 6", "--max-new", "6"];
    let o = Command::new(&bin).arg("run").args(args).current_dir(&alone).output().unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let mut run = vec!["run", compiled.to_str().unwrap()];
    run.extend(args);
    let r = moeforge(&run, None);
    assert!(r.status.success());
    let (got, want) = (request_tokens(&text(&o.stdout)), request_tokens(&text(&r.stdout)));
    assert_eq!(got.len(), 2);
    assert_eq!(got, want);
}

#[test]
fn a_binary_refuses_a_machine_that_does_not_fit() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dep");
    build("examples/deepseek-v3-h100x32.moe", &out);
    let bin = out.join("bin/deepseek-v3-h100x32");
    for cmd in [vec!["info"], vec!["serve", "--weights", "/nonexistent"]] {
        let o = Command::new(&bin).args(&cmd).output().unwrap();
        assert_eq!(o.status.code(), Some(1), "{cmd:?}");
        let e = text(&o.stderr);
        assert!(e.contains("does not fit") && e.contains("`h100x32` has 4 nodes"), "{cmd:?}: {e}");
        assert!(!e.contains("panicked"));
    }
    // A launcher environment for another cluster is refused too.
    let tiny = tmp.path().join("tiny");
    build("examples/tiny-qwen3-cpu4.moe", &tiny);
    let o = Command::new(tiny.join("bin/tiny-qwen3-cpu4"))
        .args(["serve", "--weights", "/nonexistent"])
        .env("MOEFORGE_NODES", "2")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("MOEFORGE_NODES is 2"), "{}", text(&o.stderr));
    // A damaged binary is an error, not a panic.
    let mut bytes = std::fs::read(tiny.join("bin/tiny-qwen3-cpu4")).unwrap();
    let n = bytes.len();
    bytes[n - 100] ^= 0xff;
    let broken = tmp.path().join("broken");
    std::fs::write(&broken, bytes).unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&broken, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    let o = Command::new(&broken).arg("info").output().unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o.stderr).contains("damaged"), "{}", text(&o.stderr));
}

fn docs(path: &Path) -> Vec<Yaml> {
    YamlLoader::load_from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn launchers_are_sized_from_the_cluster_block() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("dep");
    build("examples/deepseek-v3-h100x32.moe", &out);
    // Kubernetes: one pod per node, GPUs per node, probes on /health.
    let d = docs(&out.join("launch/k8s.yaml"));
    let kinds: Vec<&str> = d.iter().map(|x| x["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["Service", "Service", "StatefulSet"]);
    assert_eq!(d[0]["spec"]["clusterIP"].as_str(), Some("None"), "the first Service is headless");
    let sts = &d[2];
    assert_eq!(sts["spec"]["replicas"].as_i64(), Some(4));
    assert_eq!(sts["spec"]["serviceName"], d[0]["metadata"]["name"]);
    let c = &sts["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["resources"]["limits"]["nvidia.com/gpu"].as_i64(), Some(8));
    // /health is 503 once the engine is out of service: not ready, then restarted.
    for probe in ["readinessProbe", "startupProbe", "livenessProbe"] {
        assert_eq!(c[probe]["httpGet"]["path"].as_str(), Some("/health"), "{probe}");
    }
    assert_eq!(c["command"][0].as_str(), Some("/usr/local/bin/deepseek-v3-h100x32"));
    let env: Vec<&str> = c["env"].as_vec().unwrap().iter().map(|e| e["name"].as_str().unwrap()).collect();
    assert_eq!(env, ["MOEFORGE_NODES", "MOEFORGE_NODE_RANK", "MOEFORGE_LEADER_ADDR", "MOEFORGE_LEADER_PORT"]);
    for f in ["k8s.md", "slurm.md"] {
        assert!(std::fs::read_to_string(out.join("launch").join(f)).unwrap().contains("deepseek-v3-h100x32"));
    }

    // Slurm: the directives, and the script run under a fake Slurm (srun
    // starts one task per node with its node id) against a fake binary that
    // records what each task got.
    let sbatch = out.join("launch/slurm.sbatch");
    let script = std::fs::read_to_string(&sbatch).unwrap();
    for line in ["#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-node=8"] {
        assert!(script.lines().any(|l| l == line), "missing {line}");
    }
    let fake = tmp.path().join("fake");
    std::fs::create_dir(&fake).unwrap();
    let log = tmp.path().join("tasks.log");
    let write = |name: &str, body: &str| {
        let p = fake.join(name);
        std::fs::write(&p, body).unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
    };
    write("scontrol", "#!/bin/bash\nprintf 'gpu-a\\ngpu-b\\ngpu-c\\ngpu-d\\n'\n");
    write(
        "srun",
        "#!/bin/bash\nwhile [[ \"$1\" == --* ]]; do shift; done\nfor i in 0 1 2 3; do SLURM_NODEID=$i \"$@\"; done\n",
    );
    write(
        "task",
        &format!(
            "#!/bin/bash\necho \"rank=$MOEFORGE_NODE_RANK nodes=$MOEFORGE_NODES leader=$MOEFORGE_LEADER_ADDR:$MOEFORGE_LEADER_PORT args=$*\" >> {}\n",
            log.display()
        ),
    );
    let o = Command::new("bash")
        .arg(&sbatch)
        .env("PATH", format!("{}:/usr/bin:/bin", fake.display()))
        .env("SLURM_JOB_NUM_NODES", "4")
        .env("SLURM_JOB_NODELIST", "gpu-[a-d]")
        .env("MOEFORGE_BIN", fake.join("task"))
        .env("MOEFORGE_WEIGHTS", "/ckpt")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o.stderr));
    let tasks = std::fs::read_to_string(&log).unwrap();
    let want: Vec<String> = (0..4)
        .map(|i| format!("rank={i} nodes=4 leader=gpu-a:29500 args=serve --weights /ckpt --host 0.0.0.0 --port 8000"))
        .collect();
    assert_eq!(tasks.lines().collect::<Vec<_>>(), want);
    // A job of the wrong size is refused before any task starts.
    let o = Command::new("bash")
        .arg(&sbatch)
        .env("PATH", format!("{}:/usr/bin:/bin", fake.display()))
        .env("SLURM_JOB_NUM_NODES", "2")
        .env("SLURM_JOB_NODELIST", "gpu-[a-b]")
        .env("MOEFORGE_WEIGHTS", "/ckpt")
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o.stderr).contains("the bundle is for 4 node(s), the job has 2"), "{}", text(&o.stderr));
}
