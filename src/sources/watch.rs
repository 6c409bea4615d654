//! Watching files and directories: notify's events, batched over a settle window (editors write in
//! bursts), reads ignored (our own reads would feed back as events), overflows and errors turned
//! into a rescan.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use notify::event::{AccessKind, AccessMode};
use notify::{EventKind, RecommendedWatcher, RecursiveMode, Watcher};
use tracing::warn;

/// Events arriving within this window of the first are handled together. The window is fixed: a
/// directory written without pause is still handled every window.
pub const SETTLE: Duration = Duration::from_millis(20);

/// How long a manifest that was emptied must stay empty before its objects go: editors that
/// truncate before they write, and copies in progress, empty a file for a moment.
pub const EMPTIED_GRACE: Duration = Duration::from_secs(1);

/// Paths a handler wants read again once [`EMPTIED_GRACE`] has passed (emptied files).
pub type Recheck = BTreeSet<PathBuf>;

/// What one settle window of events asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum Batch {
    /// Events were lost or unreadable: look at everything again.
    Rescan,
    /// These paths (files or directories) were created, written, removed or renamed.
    Paths(BTreeSet<PathBuf>),
}

/// Keeps a watch running; dropping it stops the events (the handler thread then ends).
pub struct Watch {
    _watcher: RecommendedWatcher,
}

/// Watches `target` and calls `handle` on a thread named `name`: first with a rescan (what changed
/// before the watch started), then with each batch of events, and with the paths it asks to have
/// read again once [`EMPTIED_GRACE`] has passed.
pub fn watch(
    target: &Path,
    recursive: bool,
    name: &str,
    mut handle: impl FnMut(Batch) -> Recheck + Send + 'static,
) -> Result<Watch, notify::Error> {
    let (tx, rx) = mpsc::channel::<notify::Result<notify::Event>>();
    let mut watcher = notify::recommended_watcher(move |event| {
        // The receiver is gone only once the watch is being dropped.
        let _ = tx.send(event);
    })?;
    let mode = match recursive {
        true => RecursiveMode::Recursive,
        false => RecursiveMode::NonRecursive,
    };
    watcher.watch(target, mode)?;
    std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || {
            let mut pending = Pending::default();
            pending.add(handle(Batch::Rescan));
            loop {
                let first = match pending.due {
                    None => match rx.recv() {
                        Ok(event) => event,
                        Err(_) => return,
                    },
                    Some(due) => {
                        match rx.recv_timeout(due.saturating_duration_since(Instant::now())) {
                            Ok(event) => event,
                            Err(mpsc::RecvTimeoutError::Timeout) => {
                                let paths = pending.take();
                                pending.add(handle(Batch::Paths(paths)));
                                continue;
                            }
                            Err(mpsc::RecvTimeoutError::Disconnected) => return,
                        }
                    }
                };
                let recheck = match settle(&rx, first) {
                    None => handle(Batch::Rescan),
                    Some(paths) if paths.is_empty() => Recheck::new(),
                    Some(paths) => handle(Batch::Paths(paths)),
                };
                pending.add(recheck);
            }
        })
        .map_err(notify::Error::io)?;
    Ok(Watch { _watcher: watcher })
}

/// Watches one file and calls `reload` when it may have changed. The directory is watched, since
/// editors and ConfigMap mounts replace files rather than write them; but only events naming the
/// file, or the `..data` links through which a ConfigMap mount swaps its files, count — a log
/// written beside it must not reload it (a refused file would log again, and again).
pub fn watch_file(
    path: &Path,
    name: &str,
    mut reload: impl FnMut() + Send + 'static,
) -> Result<Watch, notify::Error> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let file = path.file_name().map(std::ffi::OsString::from);
    watch(dir, false, name, move |batch| {
        let concerns = match &batch {
            Batch::Rescan => true,
            Batch::Paths(paths) => paths.iter().any(|p| {
                let name = p.file_name();
                name == file.as_deref()
                    || name.is_some_and(|n| n.to_string_lossy().starts_with(".."))
            }),
        };
        if concerns {
            reload();
        }
        Recheck::new()
    })
}

/// Whether a manifest now read as empty, which held objects, keeps them a while longer (true) or
/// has stayed empty for [`EMPTIED_GRACE`] and loses them (false). `since` is when it was first seen
/// empty; the caller clears it whenever the file reads as non-empty.
pub fn hold_emptied(since: &mut Option<Instant>) -> bool {
    let first = *since.get_or_insert_with(Instant::now);
    let held = first.elapsed() < EMPTIED_GRACE;
    if !held {
        *since = None;
    }
    held
}

/// A manifest with no document in it: only blank lines, comments and document markers.
pub fn is_blank(text: &str) -> bool {
    text.lines().all(|line| {
        let line = line.trim();
        line.is_empty() || line.starts_with('#') || line == "---" || line == "..."
    })
}

/// At most a few of `names`, for a log line about what an emptied file removed.
pub fn some_of(names: impl Iterator<Item = String>) -> String {
    let names: Vec<String> = names.collect();
    match names.len() {
        0..=5 => names.join(", "),
        n => format!("{} and {} more", names[..5].join(", "), n - 5),
    }
}

/// Paths to read again, and when.
#[derive(Default)]
struct Pending {
    due: Option<Instant>,
    paths: Recheck,
}

impl Pending {
    fn add(&mut self, paths: Recheck) {
        if paths.is_empty() {
            return;
        }
        self.due
            .get_or_insert_with(|| Instant::now() + EMPTIED_GRACE);
        self.paths.extend(paths);
    }

    fn take(&mut self) -> Recheck {
        self.due = None;
        std::mem::take(&mut self.paths)
    }
}

/// The paths of `first` and of every event arriving within [`SETTLE`] of it (None: rescan).
fn settle(
    events: &mpsc::Receiver<notify::Result<notify::Event>>,
    first: notify::Result<notify::Event>,
) -> Option<BTreeSet<PathBuf>> {
    let deadline = Instant::now() + SETTLE;
    let mut paths = Some(BTreeSet::new());
    add(&mut paths, first);
    while let Ok(more) = events.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
        add(&mut paths, more);
    }
    paths
}

/// Folds one event into the batch (None: rescan).
fn add(paths: &mut Option<BTreeSet<PathBuf>>, event: notify::Result<notify::Event>) {
    match event {
        Ok(event) if is_read(&event.kind) => {}
        Ok(event) if !event.need_rescan() => {
            if let Some(paths) = paths.as_mut() {
                paths.extend(event.paths);
            }
        }
        Ok(_) => {
            warn!("file watch overflowed; rescanning");
            *paths = None;
        }
        Err(e) => {
            warn!(error = %e, "file watch error; rescanning");
            *paths = None;
        }
    }
}

/// Opening or reading a file changes nothing; a write that ends (close-write) does count.
fn is_read(kind: &EventKind) -> bool {
    matches!(kind, EventKind::Access(access) if !matches!(access, AccessKind::Close(AccessMode::Write)))
}

/// `*.yaml` or `*.yml`, not hidden (editors' swap and temporary files are).
pub fn is_manifest(path: &Path) -> bool {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    (name.ends_with(".yaml") || name.ends_with(".yml")) && !name.starts_with('.')
}

/// A hash of a file's content: unchanged content is not parsed again.
pub fn fingerprint(text: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    text.hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_blank_manifest_has_no_document() {
        assert!(is_blank(""));
        assert!(is_blank("\n# emptied\n---\n  \n...\n"));
        assert!(!is_blank("---\napiVersion: v1\n"));
    }

    #[test]
    fn an_emptied_file_is_held_for_the_grace() {
        let mut since = None;
        assert!(hold_emptied(&mut since), "first seen empty");
        assert!(since.is_some());
        since = Some(Instant::now() - EMPTIED_GRACE);
        assert!(!hold_emptied(&mut since), "empty for the whole grace");
        assert!(since.is_none());
    }

    fn written(path: &str) -> notify::Result<notify::Event> {
        Ok(
            notify::Event::new(EventKind::Modify(notify::event::ModifyKind::Any))
                .add_path(PathBuf::from(path)),
        )
    }

    #[test]
    fn a_batch_closes_while_events_keep_coming() {
        let (tx, rx) = mpsc::channel();
        let writer = std::thread::spawn(move || {
            // A directory written every millisecond for far longer than a window.
            for i in 0..2_000 {
                if tx.send(written(&format!("/c/f{i}.yaml"))).is_err() {
                    return i;
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            2_000
        });
        let first = rx.recv().unwrap();
        let batch = settle(&rx, first).expect("paths, not a rescan");
        drop(rx);
        let sent = writer.join().unwrap();
        assert!(!batch.is_empty());
        assert!(sent < 2_000, "the batch waited for the writes to stop");
    }
}
