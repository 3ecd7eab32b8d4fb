//! Does this machine fit the bundle? What a deployable binary checks at
//! start, before it allocates anything.
//!
//! The host is probed from Linux's `/proc`: available memory
//! (`/proc/meminfo`'s `MemAvailable`) and the NVIDIA GPUs the driver lists
//! (`/proc/driver/nvidia/gpus/*/information`). The CPU backend runs every
//! rank of one node in this process with each rank's unified buffer in host
//! memory, so it needs a one-node cluster and `group × buffer_bytes` of
//! available memory. Backends that run on GPUs (none in this build) will
//! check the GPU count and architecture here.

use moeforge_plan::Plan;
use std::path::Path;

/// What the machine has.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Host {
    /// Bytes of memory available to a new process, when known.
    pub mem_available: Option<u64>,
    /// The model name of each NVIDIA GPU the driver lists.
    pub gpus: Vec<String>,
}

impl Host {
    /// Probes this machine.
    pub fn probe() -> Host {
        Host::probe_at(Path::new("/proc"))
    }

    /// Probes a `/proc`-shaped tree (tests give a fake one).
    pub fn probe_at(proc: &Path) -> Host {
        let mem_available = std::fs::read_to_string(proc.join("meminfo")).ok().and_then(|t| {
            t.lines().find_map(|l| {
                let kb = l.strip_prefix("MemAvailable:")?.trim().strip_suffix("kB")?.trim();
                kb.parse::<u64>().ok().map(|k| k * 1024)
            })
        });
        let mut gpus: Vec<(String, String)> = std::fs::read_dir(proc.join("driver/nvidia/gpus"))
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| {
                let info = std::fs::read_to_string(e.path().join("information")).ok()?;
                let model = info.lines().find_map(|l| l.strip_prefix("Model:").map(|m| m.trim().to_string()))?;
                Some((e.file_name().to_string_lossy().into_owned(), model))
            })
            .collect();
        gpus.sort();
        Host { mem_available, gpus: gpus.into_iter().map(|(_, m)| m).collect() }
    }
}

/// Why the machine does not fit.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Mismatch {
    #[error("the bundle's cluster `{cluster}` has {nodes} nodes; the cpu backend runs one node in one process")]
    Nodes { cluster: String, nodes: u32 },
    #[error("the cpu backend holds {ranks} rank buffers of {buffer} bytes in host memory ({need} bytes); this machine has {have} bytes available")]
    Memory { ranks: u32, buffer: u64, need: u64, have: u64 },
}

/// Checks that the CPU backend can run `plan` on `host`.
pub fn check_cpu(plan: &Plan, host: &Host) -> Result<(), Mismatch> {
    if plan.cluster.nodes != 1 {
        return Err(Mismatch::Nodes { cluster: plan.cluster.name.clone(), nodes: plan.cluster.nodes });
    }
    let ranks = plan.memory.group;
    let need = u64::from(ranks).saturating_mul(plan.memory.buffer_bytes);
    match host.mem_available {
        Some(have) if have < need => Err(Mismatch::Memory { ranks, buffer: plan.memory.buffer_bytes, need, have }),
        _ => Ok(()),
    }
}

/// One line on the GPUs the bundle's cluster wants and what the host has.
pub fn describe_gpus(plan: &Plan, host: &Host) -> String {
    let c = &plan.cluster;
    let want = format!("{} × {} {} per node ({})", c.nodes, c.gpus_per_node, c.gpu, c.arch.name());
    if host.gpus.is_empty() {
        format!("the cluster has {want}; this machine lists no NVIDIA GPU")
    } else {
        format!("the cluster has {want}; this machine has {} GPUs: {}", host.gpus.len(), host.gpus.join(", "))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn probes_a_proc_tree() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("meminfo"), "MemTotal:  1000 kB\nMemAvailable:   2048 kB\n").unwrap();
        for (bus, model) in [("0000:1b:00.0", "NVIDIA H100 80GB HBM3"), ("0000:0a:00.0", "NVIDIA H100 80GB HBM3")] {
            let d = dir.path().join("driver/nvidia/gpus").join(bus);
            std::fs::create_dir_all(&d).unwrap();
            std::fs::write(d.join("information"), format!("Model: \t\t {model}\nIRQ: 1\n")).unwrap();
        }
        let h = Host::probe_at(dir.path());
        assert_eq!(h.mem_available, Some(2048 * 1024));
        assert_eq!(h.gpus, vec!["NVIDIA H100 80GB HBM3".to_string(); 2]);
        let none = Host::probe_at(&dir.path().join("absent"));
        assert_eq!(none, Host::default());
    }
}
