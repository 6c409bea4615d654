//! A listener that cannot accept (out of file descriptors) waits before trying again instead of
//! spinning, and resumes once descriptors are free. Its own test binary: it lowers the process's
//! descriptor limit.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const CLIENTS: usize = 20;
/// Opens CLIENTS connections from another process (so they use none of ours) and holds them.
const HOLD_CONNECTIONS: &str = "
import socket, sys
held = [socket.create_connection(('127.0.0.1', int(sys.argv[1]))) for _ in range(int(sys.argv[2]))]
print('connected', flush=True)
sys.stdin.read()
";

fn set_descriptor_limit(soft: u64) {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit/setrlimit only read and write the struct we own.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit), 0);
        limit.rlim_cur = soft;
        assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &limit), 0);
    }
}

fn open_descriptors() -> u64 {
    // The directory handle of the listing itself is one of them.
    std::fs::read_dir("/proc/self/fd").expect("/proc").count() as u64 - 1
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn accept_backs_off_while_out_of_descriptors_and_resumes() {
    let mut acceptor = meshpilot::listen::bind("test", "127.0.0.1:0".parse().unwrap())
        .await
        .expect("bind");
    let port = acceptor.local_addr().unwrap().port();
    let failures = acceptor.failures();
    let accepted = Arc::new(AtomicUsize::new(0));
    let counter = accepted.clone();
    let task = tokio::spawn(async move {
        let mut held = Vec::new();
        loop {
            let (stream, _) = acceptor.accept().await;
            held.push(stream);
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });

    let mut previous = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as above.
    unsafe { assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut previous), 0) };
    let mut clients = Command::new("python3")
        .args([
            "-c",
            HOLD_CONNECTIONS,
            &port.to_string(),
            &CLIENTS.to_string(),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("python3");
    // Room for two more descriptors: two connections are accepted, then accept fails.
    set_descriptor_limit(open_descriptors() + 2);
    let mut line = String::new();
    BufReader::new(clients.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), "connected");

    // From the fifth failed accept to the seventh: a spinning loop takes microseconds, a backing-off
    // one waits 80 + 160 ms (at least 160 ms whichever failure the first look catches).
    let failed = |n: u64| {
        let failures = failures.clone();
        async move {
            let deadline = Instant::now() + Duration::from_secs(5);
            while failures.load(Ordering::Relaxed) < n {
                assert!(Instant::now() < deadline, "accept did not fail {n} times");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Instant::now()
        }
    };
    let fifth = failed(5).await;
    let seventh = failed(7).await;
    set_descriptor_limit(previous.rlim_cur);
    let took = seventh - fifth;
    assert!(
        took >= Duration::from_millis(100),
        "two more failed accepts within {took:?}: the listener spins instead of backing off"
    );
    assert!(accepted.load(Ordering::Relaxed) < CLIENTS);

    // Descriptors are back: the waiting connections are accepted within the longest backoff.
    let deadline = Instant::now() + Duration::from_secs(5);
    while accepted.load(Ordering::Relaxed) < CLIENTS {
        assert!(
            Instant::now() < deadline,
            "accepting did not resume: {} of {CLIENTS}",
            accepted.load(Ordering::Relaxed)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    task.abort();
    drop(clients.stdin.take());
    let _ = clients.kill();
    let _ = clients.wait();
}
