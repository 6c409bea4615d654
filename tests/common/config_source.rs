//! meshpilot on the bundled two clusters with its Istio config from files or from the config
//! cluster's API server (a test API server standing in for cluster1), so a scenario can run against
//! both sources alike.

use std::path::Path;

use super::{copy_tree, start_meshpilot, start_meshpilot_with, write_atomic, EXAMPLE};

#[derive(Clone, Copy, Debug)]
pub enum Source {
    Files,
    /// cluster1 is the config cluster (a test API server); cluster2 stays a file cluster.
    ConfigCluster,
}

pub struct ConfigFixture {
    pub mp: meshpilot::app::Running,
    pub dir: tempfile::TempDir,
    api: Option<test_apiserver::TestApiServer>,
    _kubeconfig: Option<tempfile::NamedTempFile>,
}

impl ConfigFixture {
    /// Starts meshpilot with `flags` and the initial config (file name, YAML).
    pub async fn start(source: Source, config: &[(&str, &str)], flags: &[&str]) -> Self {
        let dir = copy_tree(Path::new(EXAMPLE));
        let root = dir.path().join("config");
        std::fs::create_dir_all(&root).expect("config dir");
        match source {
            Source::Files => {
                for (name, text) in config {
                    let path = root.join(name);
                    if let Some(parent) = path.parent() {
                        std::fs::create_dir_all(parent).expect("config subdirectory");
                    }
                    std::fs::write(path, text).expect("write config");
                }
                let mp = start_meshpilot(dir.path(), flags).await;
                Self {
                    mp,
                    dir,
                    api: None,
                    _kubeconfig: None,
                }
            }
            Source::ConfigCluster => {
                let api = test_apiserver::TestApiServer::start().await;
                let cluster1 = dir.path().join("clusters/cluster1");
                for entry in std::fs::read_dir(&cluster1).expect("cluster1") {
                    let path = entry.expect("entry").path();
                    api.apply_yaml(&std::fs::read_to_string(path).expect("manifest"));
                }
                std::fs::remove_dir_all(&cluster1).expect("remove cluster1");
                for (_, text) in config {
                    api.apply_yaml(text);
                }
                let kubeconfig = tempfile::NamedTempFile::new().expect("temp file");
                std::fs::write(kubeconfig.path(), api.kubeconfig(api.admin_token()))
                    .expect("write kubeconfig");
                let path = kubeconfig.path().to_str().expect("utf-8").to_string();
                let dir_arg = dir.path().to_str().expect("utf-8").to_string();
                let mut args = vec![
                    "--kubeconfig",
                    &path,
                    "--cluster-id",
                    "cluster1",
                    "--config-dir",
                    &dir_arg,
                ];
                args.extend_from_slice(flags);
                let mp = start_meshpilot_with(&args).await;
                Self {
                    mp,
                    dir,
                    api: Some(api),
                    _kubeconfig: Some(kubeconfig),
                }
            }
        }
    }

    /// The config cluster's API server, when the config comes from one.
    pub fn api(&self) -> Option<&test_apiserver::TestApiServer> {
        self.api.as_ref()
    }

    /// Adds or replaces config: the file `file` under config/, or its objects in the API server.
    pub fn apply(&self, file: &str, yaml: &str) {
        match &self.api {
            None => write_atomic(&self.dir.path().join("config").join(file), yaml),
            Some(api) => api.apply_yaml(yaml),
        }
    }

    /// Removes config: the file, or the object.
    pub fn delete(&self, file: &str, kind: &str, namespace: &str, name: &str) {
        match &self.api {
            None => std::fs::remove_file(self.dir.path().join("config").join(file))
                .expect("remove config file"),
            Some(api) => {
                api.delete(kind, namespace, name);
            }
        }
    }
}

/// Declares a scenario's two tests, `$files` and `$cluster`: the same scenario against each source.
#[macro_export]
macro_rules! from_both_sources {
    ($scenario:ident, $files:ident, $cluster:ident) => {
        #[tokio::test]
        async fn $files() {
            $scenario($crate::common::config_source::Source::Files).await;
        }

        #[tokio::test]
        async fn $cluster() {
            $scenario($crate::common::config_source::Source::ConfigCluster).await;
        }
    };
}
