//! check + plan + emit (no nvcc, no disk) of every example deployment.
//! Goal for the v1 pipeline: under 50 ms each on a 2-core machine.

use criterion::{criterion_group, criterion_main, Criterion};
use moeforge::codegen::{self, NvccMode};
use moeforge::dsl::{check_paths, MemLoader};
use std::path::{Path, PathBuf};

fn files() -> Vec<(String, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut out = Vec::new();
    for dir in ["models", "examples"] {
        for e in std::fs::read_dir(root.join(dir)).into_iter().flatten().flatten() {
            let p = e.path();
            if p.extension().is_none_or(|x| x != "moe") {
                continue;
            }
            let text = std::fs::read_to_string(&p).unwrap_or_default();
            out.push((format!("{dir}/{}", p.file_name().unwrap_or_default().to_string_lossy()), text));
        }
    }
    out.sort();
    out
}

fn bench(c: &mut Criterion) {
    let files = files();
    // Read from memory so the benchmark measures the compiler, not the disk.
    let loader = MemLoader::new(files.iter().map(|(p, t)| (p.as_str(), t.as_str())));
    let mut group = c.benchmark_group("check+compile");
    for (path, _) in files.iter().filter(|(p, _)| p.starts_with("examples/")) {
        let name = path.trim_start_matches("examples/").trim_end_matches(".moe").to_string();
        group.bench_function(&name, |b| {
            b.iter(|| {
                let checked = check_paths(&[PathBuf::from(path)], &loader).ok();
                let checked = checked.as_ref().map(|c| (c, moeforge::dsl::spec::DeployId(0)));
                let bundle = checked.and_then(|(c, id)| {
                    let plan = codegen::plan_deployment(c, id).ok()?;
                    codegen::emit(c, id, &plan, &NvccMode::Off).ok()
                });
                assert!(bundle.is_some(), "{path} failed to compile");
                bundle
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
