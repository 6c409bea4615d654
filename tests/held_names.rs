//! What a client's resource names cost the server, measured with the allocator meshpilot runs
//! with (jemalloc, counting each allocation's usable size): the budget a stream is held to
//! (`held_bytes`) must count at least that, also for the shortest names, where fixed costs
//! dominate. Run with `--nocapture` for the figures.

use std::alloc::{GlobalAlloc, Layout};
use std::collections::HashMap;
use std::sync::atomic::{AtomicIsize, Ordering};

use meshpilot::xds::protocol::{DeltaRequest, DeltaStream, ResourceType, SotwStream};
use tikv_jemallocator::Jemalloc;

/// jemalloc, with the bytes it has handed out (size classes included) counted.
struct Counting;

static ALLOCATED: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = unsafe { Jemalloc.alloc(layout) };
        if !ptr.is_null() {
            let size = unsafe { tikv_jemallocator::usable_size(ptr) };
            ALLOCATED.fetch_add(size as isize, Ordering::Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        let size = unsafe { tikv_jemallocator::usable_size(ptr) };
        ALLOCATED.fetch_sub(size as isize, Ordering::Relaxed);
        unsafe { Jemalloc.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

const NAMES: usize = 100_000;

/// Names of `len` bytes, all distinct.
fn names(len: usize) -> Vec<String> {
    (0..NAMES).map(|i| format!("{i:0len$}")).collect()
}

/// The bytes a stream holds after `fill`, per name, beside what it accounts per name.
fn measure<S: Default>(fill: impl FnOnce(&mut S) -> usize) -> (f64, f64) {
    let before = ALLOCATED.load(Ordering::Relaxed);
    let mut stream = S::default();
    let accounted = fill(&mut stream);
    let held = ALLOCATED.load(Ordering::Relaxed) - before;
    let per = |bytes: f64| bytes / NAMES as f64;
    let figures = (per(held as f64), per(accounted as f64));
    drop(stream);
    figures
}

#[test]
fn every_name_a_client_makes_the_server_hold_is_accounted_at_its_cost() {
    for len in [6, 24, 60, 120] {
        let announced = names(len);
        let (held, accounted) = measure(|stream: &mut DeltaStream| {
            let initial_versions: HashMap<String, String> = announced
                .iter()
                .map(|n| (n.clone(), format!("{:016x}", n.len())))
                .collect();
            stream.on_request(DeltaRequest {
                ty: ResourceType::Cluster,
                subscribe: Vec::new(),
                unsubscribe: Vec::new(),
                initial_versions,
                nonce: "",
                error: None,
            });
            stream.watches.values().map(|w| w.held_bytes).sum()
        });
        eprintln!("Delta initial_resource_versions, {len}-byte names, 16-byte versions: {held:.0} B held per name, {accounted:.0} B accounted");
        assert!(
            accounted >= held,
            "{len}-byte announced names: {accounted:.0} B accounted, {held:.0} B held"
        );

        let subscribed = names(len);
        let (held, accounted) = measure(|stream: &mut DeltaStream| {
            stream.on_request(DeltaRequest {
                ty: ResourceType::Endpoint,
                subscribe: subscribed.clone(),
                unsubscribe: Vec::new(),
                initial_versions: HashMap::new(),
                nonce: "",
                error: None,
            });
            stream.watches.values().map(|w| w.held_bytes).sum()
        });
        eprintln!("Delta subscriptions, {len}-byte names: {held:.0} B held per name, {accounted:.0} B accounted");
        assert!(
            accounted >= held,
            "{len}-byte Delta names: {accounted:.0} B accounted, {held:.0} B held"
        );

        let asked = names(len);
        let (held, accounted) = measure(|stream: &mut SotwStream| {
            stream.on_request(ResourceType::Endpoint, asked.clone(), "", "", None);
            stream.watches.values().map(|w| w.held_bytes).sum()
        });
        eprintln!(
            "SotW names, {len}-byte names: {held:.0} B held per name, {accounted:.0} B accounted"
        );
        assert!(
            accounted >= held,
            "{len}-byte SotW names: {accounted:.0} B accounted, {held:.0} B held"
        );
    }
}
