//! MCP config sync: a registry (`tests/peers/mcp_registry.py`, grpcio) holds N ServiceEntries;
//! measured is the time from meshpilot's start until, taking the registry as its `xds://` source,
//! it serves every entry as a service, and its CPU for that — beside the simplest client that
//! could do the job, in the same run: one subscription, every resource and body decoded (the
//! transport's and decoding's floor, with nothing validated or indexed).
//!
//!   cargo bench --bench mcp_sync -- [--entries N] [--rounds R]
//!
//! Without arguments it is a small smoke run (what CI runs).

#[path = "../tests/common/mod.rs"]
#[allow(unused_imports)]
mod common;
#[allow(dead_code)] // each harness uses its own subset
mod harness;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::discovery::v3::aggregated_discovery_service_client::AggregatedDiscoveryServiceClient;
use envoy_types::pb::envoy::service::discovery::v3::DiscoveryRequest;
use harness::rounds::flag;
use meshpilot::istio::mcp::Resource;
use prost::Message;

const SERVICE_ENTRY: &str = "networking.istio.io/v1/ServiceEntry";
const BOUND: Duration = Duration::from_secs(300);

/// This process's CPU time so far (user and system).
fn cpu() -> Duration {
    // SAFETY: getrusage fills the struct it is given; RUSAGE_SELF is a valid target.
    let usage = unsafe {
        let mut usage: libc::rusage = std::mem::zeroed();
        libc::getrusage(libc::RUSAGE_SELF, &mut usage);
        usage
    };
    let time = |t: libc::timeval| Duration::new(t.tv_sec as u64, t.tv_usec as u32 * 1000);
    time(usage.ru_utime) + time(usage.ru_stime)
}

/// The floor: subscribe, read the response, decode every resource and its body.
async fn naive_sync(port: u16) -> usize {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .expect("endpoint")
        .connect()
        .await
        .expect("the registry answers");
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(DiscoveryRequest {
        type_url: SERVICE_ENTRY.into(),
        ..Default::default()
    })
    .expect("queued");
    let mut client =
        AggregatedDiscoveryServiceClient::new(channel).max_decoding_message_size(1 << 30);
    let mut stream = client
        .stream_aggregated_resources(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .expect("the stream opens")
        .into_inner();
    let response = stream.message().await.expect("a response").expect("one");
    response
        .resources
        .iter()
        .filter(|any| {
            let resource = Resource::decode(any.value.as_slice()).expect("a resource");
            let body = resource.body.expect("a body");
            meshpilot::envoy_api::unpack(&body.type_url, &body.value).is_ok()
        })
        .count()
}

async fn round(entries: usize) -> (Duration, Duration, Duration) {
    let port = common::free_port().port();
    let _registry = common::Peer::start(
        "mcp_registry.py",
        &[&port.to_string(), &entries.to_string()],
    );
    common::wait_for("the registry listening", BOUND, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .ok()
            .map(|_| ())
    })
    .await;
    let started = Instant::now();
    assert_eq!(naive_sync(port).await, entries);
    let naive = started.elapsed();

    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::create_dir_all(dir.path().join("clusters")).expect("clusters dir");
    let mesh = dir.path().join("mesh.yaml");
    std::fs::write(
        &mesh,
        format!("configSources:\n- address: xds://127.0.0.1:{port}\n"),
    )
    .expect("mesh config");
    let (cpu_before, started) = (cpu(), Instant::now());
    let mp = common::start_meshpilot_unready(&[
        "--config-dir",
        dir.path().to_str().expect("utf-8"),
        "--mesh-config",
        mesh.to_str().expect("utf-8"),
    ])
    .await;
    common::wait_for("every entry a service", BOUND, || async {
        (mp.aggregate.mesh().snapshot().services.len() >= entries).then_some(())
    })
    .await;
    (started.elapsed(), cpu() - cpu_before, naive)
}

fn main() {
    let entries = flag("--entries", 200);
    let rounds = flag("--rounds", 1);
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    println!("entries  meshpilot sync  meshpilot CPU  naive client (decode only)");
    for _ in 0..rounds {
        let (sync, cpu, naive) = runtime.block_on(round(entries));
        println!(
            "{entries:>7}  {:>11.0} ms  {:>10.0} ms  {:>11.0} ms",
            sync.as_secs_f64() * 1e3,
            cpu.as_secs_f64() * 1e3,
            naive.as_secs_f64() * 1e3
        );
    }
}
