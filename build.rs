//! Compiles our own protos (proto/) with a pure-Rust protobuf compiler: no system protoc needed.
//! Also writes the descriptors of Envoy's API (from the envoy-types crate's proto sources) that
//! the debug config dump needs to print Envoy resources as protobuf JSON, and those of Istio's
//! config API (proto/istio) that MCP bodies carry.

use std::path::{Path, PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-changed=Cargo.lock");
    let descriptors = protox::compile(
        [
            "ca.proto",
            "nds.proto",
            "stats.proto",
            "typed_struct.proto",
            "istio/mcp/v1alpha1/resource.proto",
            "istio/workload/workload.proto",
            "istio/security/authorization.proto",
            "istio/mesh/v1alpha1/proxy.proto",
        ],
        ["proto"],
    )?;
    tonic_prost_build::configure()
        // Sorted maps encode the same table to the same bytes, so an unchanged table is not resent.
        .btree_map(".istio.networking.nds.v1")
        .btree_map(".istio.workload")
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    envoy_descriptors()
}

/// Every Envoy API file envoy-types ships, compiled into one descriptor set in OUT_DIR.
fn envoy_descriptors() -> Result<(), Box<dyn std::error::Error>> {
    let root = envoy_types_protos()?;
    let api = root.join("data-plane-api");
    let mut files = Vec::new();
    collect_protos(&api.join("envoy"), &mut files)?;
    // The package envoy.extensions.config would capture the relative `config.core.v3.…`
    // references of every other extension (protoc only sees a file's imports; protox sees all).
    let shadowing = api.join("envoy/extensions/config");
    files.retain(|f| !f.starts_with(&shadowing));
    files.sort();
    let includes = [
        api.clone(),
        root.join("xds"),
        root.join("protoc-gen-validate"),
        root.join("googleapis"),
        root.join("cel-spec/proto"),
        root.join("opentelemetry-proto"),
        root.join("client_model"),
        root.join("ratelimit/api"),
        PathBuf::from("proto"),
    ];
    let mut compiler = protox::Compiler::new(includes)?;
    compiler.include_imports(true);
    // A few extensions do not compile (they import what envoy-types does not ship, or their
    // relative names are captured by a sibling package); none is used by meshpilot, and a unit
    // test checks every type meshpilot embeds has its descriptor.
    for file in &files {
        let _ = compiler.open_file(file.strip_prefix(&api)?);
    }
    // Configs meshpilot wraps in Envoy resources for Istio's proxies: printed in config dumps too.
    compiler.open_file("typed_struct.proto")?;
    compiler.open_file("stats.proto")?;
    // Istio's config API (MCP bodies), read and written by reflection.
    let mut istio = Vec::new();
    collect_protos(Path::new("proto/istio"), &mut istio)?;
    istio.sort();
    for file in &istio {
        compiler.open_file(file.strip_prefix("proto")?)?;
    }
    let out = PathBuf::from(std::env::var("OUT_DIR")?).join("envoy_descriptors.bin");
    std::fs::write(out, compiler.encode_file_descriptor_set())?;
    Ok(())
}

fn collect_protos(dir: &Path, out: &mut Vec<PathBuf>) -> std::io::Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            collect_protos(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "proto") {
            out.push(path);
        }
    }
    Ok(())
}

/// The envoy-types package's `proto/` directory, wherever Cargo unpacked it.
fn envoy_types_protos() -> Result<PathBuf, Box<dyn std::error::Error>> {
    let cargo = std::env::var("CARGO")?;
    // Only the target's packages: others may not be downloaded.
    let target = std::env::var("TARGET")?;
    let metadata = |offline: bool| {
        let mut command = std::process::Command::new(&cargo);
        command
            .args(["metadata", "--format-version", "1", "--locked"])
            .args(["--filter-platform", &target])
            .current_dir(std::env::var("CARGO_MANIFEST_DIR")?);
        if offline {
            command.arg("--offline");
        }
        Ok::<_, Box<dyn std::error::Error>>(command.output()?)
    };
    // Offline first (no network when everything is here); a build without tests has not
    // downloaded the dev-dependencies metadata lists, so then let cargo fetch them.
    let mut output = metadata(true)?;
    if !output.status.success() {
        output = metadata(false)?;
    }
    if !output.status.success() {
        return Err(String::from_utf8_lossy(&output.stderr).into_owned().into());
    }
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout)?;
    let manifest = metadata["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|p| p["name"] == "envoy-types")
        .and_then(|p| p["manifest_path"].as_str())
        .ok_or("envoy-types is not among the dependencies")?;
    let dir = Path::new(manifest)
        .parent()
        .ok_or("manifest without a directory")?;
    Ok(dir.join("proto"))
}
