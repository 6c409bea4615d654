//! The process's long-lived tasks, owned in one place: servers, the push loop, watches, renewals.
//!
//! None of them is meant to end while the process runs. One that returns or panics is reported
//! with its cause (`ended`), the process stops being ready and healthy, and `meshpilot discovery`
//! exits non-zero so the kubelet (or whoever runs it) restarts it — rather than staying up, answering
//! `/ready`, and never pushing again.

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, OnceLock};

use tokio::task::{AbortHandle, Id, JoinError, JoinHandle, JoinSet};

/// A supervised task that ended: its name and why.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("critical task {task} ended: {cause}")]
pub struct TaskEnded {
    pub task: &'static str,
    pub cause: String,
}

/// Whether every supervised task is still running; shared with readiness and `/healthz`.
#[derive(Clone, Debug, Default)]
pub struct Health(Arc<OnceLock<TaskEnded>>);

impl Health {
    pub fn ok(&self) -> bool {
        self.0.get().is_none()
    }

    /// The first task that ended, if one has.
    pub fn failure(&self) -> Option<&TaskEnded> {
        self.0.get()
    }
}

#[derive(Default)]
pub struct Supervisor {
    /// Each task's output is the cause of its end.
    tasks: JoinSet<String>,
    names: HashMap<Id, &'static str>,
    /// Tasks spawned elsewhere and adopted: aborted with the rest.
    adopted: Vec<AbortHandle>,
    health: Health,
}

impl Supervisor {
    pub fn health(&self) -> Health {
        self.health.clone()
    }

    /// Runs `task` under supervision.
    pub fn spawn(&mut self, name: &'static str, task: impl Future<Output = ()> + Send + 'static) {
        let handle = self.tasks.spawn(async move {
            task.await;
            "returned".to_string()
        });
        self.names.insert(handle.id(), name);
    }

    /// Supervises a task spawned elsewhere (by a component that hands back its handle); it is
    /// aborted with the rest.
    pub fn adopt(&mut self, name: &'static str, task: JoinHandle<()>) {
        self.adopted.push(task.abort_handle());
        self.watch(name, task);
    }

    /// Watches a task a component keeps owning (`OwnedTasks`): it ends when the component goes.
    fn watch(&mut self, name: &'static str, task: JoinHandle<()>) {
        let handle = self.tasks.spawn(async move {
            match task.await {
                Ok(()) => "returned".to_string(),
                Err(e) => cause(e),
            }
        });
        self.names.insert(handle.id(), name);
    }

    /// Waits for the first task to end, records it as the process's failure and returns it. Pending
    /// forever when nothing is supervised.
    pub async fn ended(&mut self) -> TaskEnded {
        let ended = match self.tasks.join_next_with_id().await {
            None => return std::future::pending().await,
            Some(Ok((id, cause))) => TaskEnded {
                task: self.names.get(&id).copied().unwrap_or("unnamed"),
                cause,
            },
            Some(Err(e)) => TaskEnded {
                task: self.names.get(&e.id()).copied().unwrap_or("unnamed"),
                cause: cause(e),
            },
        };
        let _ = self.health.0.set(ended.clone());
        ended
    }

    /// Stops every task.
    pub fn abort_all(&mut self) {
        self.tasks.abort_all();
        for task in &self.adopted {
            task.abort();
        }
    }
}

impl Drop for Supervisor {
    fn drop(&mut self) {
        self.abort_all();
    }
}

/// The tasks a component started: aborted when the component is dropped, and handed to the
/// supervisor to be watched while it lives.
#[derive(Default)]
pub struct OwnedTasks {
    unwatched: Vec<JoinHandle<()>>,
    all: Vec<AbortHandle>,
}

impl OwnedTasks {
    pub fn push(&mut self, task: JoinHandle<()>) {
        self.all.push(task.abort_handle());
        self.unwatched.push(task);
    }

    /// Lets the supervisor watch every task not yet watched.
    pub fn supervise(&mut self, supervisor: &mut Supervisor, name: &'static str) {
        for task in self.unwatched.drain(..) {
            supervisor.watch(name, task);
        }
    }

    pub fn abort(&self) {
        for task in &self.all {
            task.abort();
        }
    }
}

impl Drop for OwnedTasks {
    fn drop(&mut self) {
        self.abort();
    }
}

/// A task's end as words: its panic message, or that it was cancelled.
fn cause(e: JoinError) -> String {
    match e.try_into_panic() {
        Ok(panic) => {
            let message = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            format!("panicked: {message}")
        }
        Err(_) => "cancelled".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn the_first_task_to_end_is_reported_with_its_cause() {
        let mut supervisor = Supervisor::default();
        let health = supervisor.health();
        supervisor.spawn("forever", std::future::pending());
        supervisor.spawn("push loop", async { panic!("index out of bounds") });
        let ended = supervisor.ended().await;
        assert_eq!(ended.task, "push loop");
        assert_eq!(ended.cause, "panicked: index out of bounds");
        assert!(!health.ok());
        assert_eq!(health.failure(), Some(&ended));
    }

    #[tokio::test]
    async fn an_adopted_task_that_returns_is_an_end_and_is_aborted_with_the_rest() {
        let mut supervisor = Supervisor::default();
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        supervisor.adopt("server", tokio::spawn(async { drop(rx.await) }));
        let forever = tokio::spawn(std::future::pending::<()>());
        let forever_abort = forever.abort_handle();
        supervisor.adopt("watch", forever);
        tx.send(()).unwrap();
        let ended = supervisor.ended().await;
        assert_eq!((ended.task, ended.cause.as_str()), ("server", "returned"));
        supervisor.abort_all();
        tokio::task::yield_now().await;
        assert!(forever_abort.is_finished());
    }
}
