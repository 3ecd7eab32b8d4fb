//! Deployable binaries and their launchers (`moeforge build`).
//!
//! A deployable binary is this very executable with a bundle appended:
//!
//! ```text
//! [moeforge executable][bundle archive][archive length: u64 LE][TRAILER_MAGIC]
//! ```
//!
//! The loader ignores bytes past the ELF image's segments, so the binary
//! runs as before; at start [`embedded`] finds the trailer and the CLI
//! becomes the deployment's (`run`, `serve`, `info`, `extract`). The
//! archive is verified exactly as a bundle directory is
//! (`load_bundle_files`: hashes, spec, plan validation). The launchers are
//! sized from the cluster block: a Slurm batch script (one task per node) and
//! a Kubernetes StatefulSet with a headless Service (one pod per node).

use moeforge_plan::bundle::{Bundle, BundleError};
use moeforge_plan::Plan;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

/// The last bytes of a deployable binary.
pub const TRAILER_MAGIC: &[u8; 16] = b"moeforge-deploy1";

/// Port the server listens on in the launchers, and the rendezvous port on
/// the leader.
pub const HTTP_PORT: u16 = 8000;
pub const RENDEZVOUS_PORT: u16 = 29500;

#[derive(Debug, thiserror::Error)]
pub enum DeployError {
    #[error("{path}: {err}")]
    Io { path: String, err: String },
    #[error("the bundle embedded in {path} is damaged: {err}")]
    Bundle { path: String, err: BundleError },
}

/// `exe` (without any bundle it carries) with `bundle` attached.
pub fn attach(exe: &[u8], bundle: &Bundle) -> Vec<u8> {
    let exe = &exe[..payload_start(exe).unwrap_or(exe.len())];
    let archive = bundle.to_archive();
    let mut out = Vec::with_capacity(exe.len() + archive.len() + 24);
    out.extend_from_slice(exe);
    out.extend_from_slice(&archive);
    out.extend_from_slice(&(archive.len() as u64).to_le_bytes());
    out.extend_from_slice(TRAILER_MAGIC);
    out
}

/// Where an attached archive starts in `bytes`, if one is attached.
fn payload_start(bytes: &[u8]) -> Option<usize> {
    let n = bytes.len();
    if n < 24 || &bytes[n - 16..] != TRAILER_MAGIC {
        return None;
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&bytes[n - 24..n - 16]);
    let len = usize::try_from(u64::from_le_bytes(len)).ok()?;
    (n - 24).checked_sub(len)
}

/// The bundle attached to the running executable, if any.
pub fn embedded() -> Result<Option<Bundle>, DeployError> {
    let exe = std::env::current_exe()
        .map_err(|e| DeployError::Io { path: "current executable".into(), err: e.to_string() })?;
    embedded_in(&exe)
}

/// The bundle attached to the executable at `path`, if any. Reads only the
/// trailer unless one is there.
pub fn embedded_in(path: &Path) -> Result<Option<Bundle>, DeployError> {
    let io = |e: std::io::Error| DeployError::Io { path: path.display().to_string(), err: e.to_string() };
    let mut f = std::fs::File::open(path).map_err(io)?;
    let size = f.metadata().map_err(io)?.len();
    if size < 24 {
        return Ok(None);
    }
    let mut tail = [0u8; 24];
    f.seek(SeekFrom::End(-24)).map_err(io)?;
    f.read_exact(&mut tail).map_err(io)?;
    if &tail[8..] != TRAILER_MAGIC {
        return Ok(None);
    }
    let mut len = [0u8; 8];
    len.copy_from_slice(&tail[..8]);
    let len = u64::from_le_bytes(len);
    let damaged = |why: &str| DeployError::Bundle {
        path: path.display().to_string(),
        err: BundleError::Parse { path: "trailer".into(), what: "deployable binary", err: why.into() },
    };
    if len > size - 24 {
        return Err(damaged("the archive length exceeds the file"));
    }
    let mut archive = vec![0u8; usize::try_from(len).map_err(|_| damaged("the archive does not fit in memory"))?];
    f.seek(SeekFrom::Start(size - 24 - len)).map_err(io)?;
    f.read_exact(&mut archive).map_err(io)?;
    Bundle::from_archive(&archive)
        .map(Some)
        .map_err(|err| DeployError::Bundle { path: path.display().to_string(), err })
}

/// The launcher files for deployment `deploy` built into `bin/<deploy>`:
/// `(path under the build directory, contents)`.
pub fn launchers(plan: &Plan, deploy: &str) -> Vec<(String, String)> {
    vec![
        ("launch/slurm.sbatch".into(), slurm(plan, deploy)),
        ("launch/slurm.md".into(), slurm_readme(plan, deploy)),
        ("launch/k8s.yaml".into(), k8s(plan, deploy)),
        ("launch/k8s.md".into(), k8s_readme(plan, deploy)),
    ]
}

/// A DNS-1123 name for Kubernetes objects.
pub fn k8s_name(deploy: &str) -> String {
    let mut s: String = deploy
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' })
        .collect::<String>()
        .trim_matches('-')
        .to_string();
    s.truncate(50);
    let s = s.trim_end_matches('-').to_string();
    if s.is_empty() {
        "moeforge".into()
    } else {
        s
    }
}

fn slurm(plan: &Plan, deploy: &str) -> String {
    let c = &plan.cluster;
    format!(
        r#"#!/bin/bash
# Launches deployment `{deploy}` on {nodes} node(s) × {gpus} {gpu} ({arch}): one task per
# node, each running bin/{deploy} with its node rank; the first node is the leader (the
# rendezvous point and the HTTP endpoint). Written by `moeforge build`; see slurm.md.
#SBATCH --job-name={deploy}
#SBATCH --nodes={nodes}
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node={gpus}
#SBATCH --exclusive
set -euo pipefail

: "${{MOEFORGE_WEIGHTS:?set MOEFORGE_WEIGHTS to the checkpoint directory (shared by every node)}}"
here="${{SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")" && pwd)}}"
bin="${{MOEFORGE_BIN:-$here/../bin/{deploy}}}"

export MOEFORGE_NODES="$SLURM_JOB_NUM_NODES"
export MOEFORGE_LEADER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
export MOEFORGE_LEADER_PORT="${{MOEFORGE_LEADER_PORT:-{rdv}}}"
if [ "$MOEFORGE_NODES" != "{nodes}" ]; then
  echo "slurm.sbatch: the bundle is for {nodes} node(s), the job has $MOEFORGE_NODES" >&2
  exit 1
fi

# Each task learns its node rank from Slurm; the binary refuses a machine that
# does not match the bundle before it loads anything.
srun --nodes="$MOEFORGE_NODES" --ntasks-per-node=1 --kill-on-bad-exit=1 \
  bash -c 'MOEFORGE_NODE_RANK="$SLURM_NODEID" exec "$0" serve --weights "$1" --host 0.0.0.0 --port {port}' \
  "$bin" "$MOEFORGE_WEIGHTS"
"#,
        deploy = deploy,
        nodes = c.nodes,
        gpus = c.gpus_per_node,
        gpu = c.gpu,
        arch = c.arch.name(),
        rdv = RENDEZVOUS_PORT,
        port = HTTP_PORT,
    )
}

fn slurm_readme(plan: &Plan, deploy: &str) -> String {
    let c = &plan.cluster;
    format!(
        r#"# Slurm: `{deploy}`

`slurm.sbatch` asks for {nodes} node(s) with {gpus} GPU(s) each (`--nodes`, `--gpus-per-node`,
one task per node, exclusive) and starts `bin/{deploy} serve` once per node:

```sh
MOEFORGE_WEIGHTS=/shared/checkpoints/{model} sbatch launch/slurm.sbatch
```

Every task gets `MOEFORGE_NODES`, `MOEFORGE_NODE_RANK` (Slurm's node id),
`MOEFORGE_LEADER_ADDR` (the first host of the allocation) and `MOEFORGE_LEADER_PORT`
(default {rdv}). Node 0 serves the OpenAI-compatible API on port {port}
(`curl http://LEADER:{port}/health`).

The binary needs nothing beside it: the bundle (plan, kernels, cubins) is inside it.
`bin/{deploy} info` prints the plan and what this machine has; `bin/{deploy} extract -o DIR`
writes the bundle out for inspection.

Status in this build: only the `cpu` backend exists, which runs one node in one
process. A multi-node bundle is refused at start with that reason; the rank and rendezvous
environment above is what the cuda backend's NCCL bootstrap (the unique id published by
the leader) will read.
"#,
        deploy = deploy,
        nodes = c.nodes,
        gpus = c.gpus_per_node,
        model = plan.model.name,
        rdv = RENDEZVOUS_PORT,
        port = HTTP_PORT,
    )
}

fn k8s(plan: &Plan, deploy: &str) -> String {
    let c = &plan.cluster;
    let name = k8s_name(deploy);
    format!(
        r#"# Deployment `{deploy}` on {nodes} node(s) × {gpus} {gpu} ({arch}). Written by `moeforge build`;
# see k8s.md. One pod per node: a StatefulSet whose pod 0 is the leader, a headless
# Service for the pods' stable names, and a Service for the API on pod 0.
apiVersion: v1
kind: Service
metadata:
  name: {name}-pods
  labels:
    app.kubernetes.io/name: {name}
spec:
  clusterIP: None
  publishNotReadyAddresses: true
  selector:
    app.kubernetes.io/name: {name}
  ports:
    - name: rendezvous
      port: {rdv}
---
apiVersion: v1
kind: Service
metadata:
  name: {name}
  labels:
    app.kubernetes.io/name: {name}
spec:
  selector:
    app.kubernetes.io/name: {name}
    apps.kubernetes.io/pod-index: "0"
  ports:
    - name: http
      port: {port}
      targetPort: http
---
apiVersion: apps/v1
kind: StatefulSet
metadata:
  name: {name}
  labels:
    app.kubernetes.io/name: {name}
spec:
  serviceName: {name}-pods
  replicas: {nodes}
  podManagementPolicy: Parallel
  selector:
    matchLabels:
      app.kubernetes.io/name: {name}
  template:
    metadata:
      labels:
        app.kubernetes.io/name: {name}
    spec:
      containers:
        - name: moeforge
          image: moeforge/{name}:latest
          command: ["/usr/local/bin/{deploy}"]
          args: ["serve", "--weights", "/weights", "--host", "0.0.0.0", "--port", "{port}"]
          env:
            - name: MOEFORGE_NODES
              value: "{nodes}"
            - name: MOEFORGE_NODE_RANK
              valueFrom:
                fieldRef:
                  fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
            - name: MOEFORGE_LEADER_ADDR
              value: {name}-0.{name}-pods
            - name: MOEFORGE_LEADER_PORT
              value: "{rdv}"
          ports:
            - name: http
              containerPort: {port}
            - name: rendezvous
              containerPort: {rdv}
          resources:
            limits:
              nvidia.com/gpu: {gpus}
          # /health answers 503 once the engine is out of service (a
          # device failure): not ready at once, restarted after 30 s. The
          # startup probe gives weight loading 30 minutes before that.
          readinessProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: 5
            failureThreshold: 3
          startupProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: 10
            failureThreshold: 180
          livenessProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: 10
            failureThreshold: 3
          volumeMounts:
            - name: weights
              mountPath: /weights
              readOnly: true
      volumes:
        - name: weights
          persistentVolumeClaim:
            claimName: {name}-weights
"#,
        deploy = deploy,
        nodes = c.nodes,
        gpus = c.gpus_per_node,
        gpu = c.gpu,
        arch = c.arch.name(),
        name = name,
        rdv = RENDEZVOUS_PORT,
        port = HTTP_PORT,
    )
}

fn k8s_readme(plan: &Plan, deploy: &str) -> String {
    let c = &plan.cluster;
    let name = k8s_name(deploy);
    format!(
        r#"# Kubernetes: `{deploy}`

`k8s.yaml` runs one pod per node of the cluster block: a StatefulSet with `replicas: {nodes}`,
each pod asking for `nvidia.com/gpu: {gpus}`, ready when `GET /health` answers 200 and
restarted when it answers 503 (the engine is out of service after a device failure; the startup
probe allows 30 minutes for loading the weights first); a headless
Service `{name}-pods` gives the pods stable names (`{name}-0.{name}-pods` is the leader), and
the Service `{name}` exposes the API of pod 0 on port {port}.

1. Put the binary in an image (it is self-contained; the bundle is inside it):

   ```dockerfile
   FROM debian:bookworm-slim
   COPY bin/{deploy} /usr/local/bin/{deploy}
   ```

   and push it as `moeforge/{name}:latest`, or edit `image:`.
2. Provide the checkpoint in a PersistentVolumeClaim named `{name}-weights` (mounted
   read-only at `/weights`).
3. `kubectl apply -f launch/k8s.yaml`, then `kubectl port-forward svc/{name} {port}` and
   `curl localhost:{port}/v1/models`.

Each pod reads its node rank from the `apps.kubernetes.io/pod-index` label (Kubernetes ≥ 1.28)
as `MOEFORGE_NODE_RANK`, and `MOEFORGE_NODES`, `MOEFORGE_LEADER_ADDR`, `MOEFORGE_LEADER_PORT`.

Status in this build: only the `cpu` backend exists, which runs one node in one process; a
multi-node bundle is refused at start with that reason. The environment above is what the
cuda backend's NCCL bootstrap will read.
"#,
        deploy = deploy,
        nodes = c.nodes,
        gpus = c.gpus_per_node,
        name = name,
        port = HTTP_PORT,
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn attaching_twice_replaces_the_bundle() {
        let exe = b"\x7fELF pretend executable".to_vec();
        let mut a = Bundle::default();
        a.add("a", b"1".to_vec());
        let mut b = Bundle::default();
        b.add("b", b"22".to_vec());
        let once = attach(&exe, &a);
        let twice = attach(&once, &b);
        assert_eq!(&twice[..exe.len()], &exe[..]);
        assert_eq!(twice.len(), exe.len() + b.to_archive().len() + 24);
        let start = payload_start(&twice).unwrap();
        assert_eq!(Bundle::from_archive(&twice[start..twice.len() - 24]).unwrap(), b);
        assert_eq!(payload_start(&exe), None);
    }

    #[test]
    fn reads_the_attached_bundle_and_refuses_a_damaged_one() {
        let dir = tempfile::tempdir().unwrap();
        let mut b = Bundle::default();
        b.add("plan.json", b"{}".to_vec());
        let path = dir.path().join("bin");
        std::fs::write(&path, attach(b"exe", &b)).unwrap();
        assert_eq!(embedded_in(&path).unwrap(), Some(b));
        std::fs::write(dir.path().join("plain"), b"just an executable").unwrap();
        assert_eq!(embedded_in(&dir.path().join("plain")).unwrap(), None);
        // A trailer whose length lies.
        let mut lying = b"exe".to_vec();
        lying.extend_from_slice(&u64::MAX.to_le_bytes());
        lying.extend_from_slice(TRAILER_MAGIC);
        std::fs::write(dir.path().join("lying"), lying).unwrap();
        assert!(embedded_in(&dir.path().join("lying")).is_err());
    }

    #[test]
    fn k8s_names_are_dns_labels() {
        assert_eq!(k8s_name("qwen3-30b-h200"), "qwen3-30b-h200");
        assert_eq!(k8s_name("My_Deploy.v2"), "my-deploy-v2");
        assert_eq!(k8s_name("__"), "moeforge");
    }
}
