//! The Kubernetes names of a container (pod, namespace, container name), read from containerd's
//! own gRPC API on its socket: `Namespaces/List`, then `Containers/Get` by the container's id in
//! each containerd namespace (the kubelet's are in `k8s.io`, `ctr`'s in `default`), and the
//! container's `io.kubernetes.pod.name`, `io.kubernetes.pod.namespace` and
//! `io.kubernetes.container.name` labels. Asked once per container id, with a short deadline;
//! what was not found is asked again after a while. Where the socket does not exist nothing is
//! asked; where it fails, that is said once on stderr.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{anyhow, Context, Result};
use containerd_client::{
    services::v1::{
        containers_client::ContainersClient, namespaces_client::NamespacesClient, GetContainerRequest,
        ListNamespacesRequest,
    },
    tonic::{transport::Channel, Code, Request},
};

use crate::process::cgroup::Container;

/// Where containerd listens unless `--containerd-socket` says otherwise.
pub const DEFAULT_SOCKET: &str = "/run/containerd/containerd.sock";
/// How long one container's lookup may take, all calls together: it runs on the sampling thread.
const DEADLINE: Duration = Duration::from_millis(200);
/// When a container that was not found, or a socket that failed, is asked again.
const RETRY_AFTER: Duration = Duration::from_secs(30);

const POD_NAME: &str = "io.kubernetes.pod.name";
const POD_NAMESPACE: &str = "io.kubernetes.pod.namespace";
const CONTAINER_NAME: &str = "io.kubernetes.container.name";

/// A container's names, as its Kubernetes labels give them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubernetesNames {
    pub pod: Option<String>,
    pub namespace: Option<String>,
    pub name: Option<String>,
}

impl KubernetesNames {
    /// The names in a container's labels (containerd's `Container.labels`); none where it has no
    /// `io.kubernetes.*` label (a container not made by the kubelet).
    pub fn from_labels(labels: &HashMap<String, String>) -> Option<Self> {
        let label = |key: &str| labels.get(key).filter(|value| !value.is_empty()).cloned();
        let names =
            Self { pod: label(POD_NAME), namespace: label(POD_NAMESPACE), name: label(CONTAINER_NAME) };
        (names != Self::default()).then_some(names)
    }

    /// Sets the names on `container` (those it has already stay).
    fn apply(&self, container: &mut Container) {
        container.pod = container.pod.take().or_else(|| self.pod.clone());
        container.namespace = container.namespace.take().or_else(|| self.namespace.clone());
        container.name = container.name.take().or_else(|| self.name.clone());
    }
}

/// What is known of a container id.
#[derive(Debug, Clone)]
enum Known {
    /// containerd has it: its names, if its labels give any.
    Found(Option<KubernetesNames>),
    /// No namespace has it (or the socket failed): asked again after this.
    Missing { retry_at: Instant },
}

/// The containers' names, asked of containerd once per container id.
pub struct ContainerNames {
    socket: PathBuf,
    /// Made at the first lookup: a runtime of one thread, driven only while a lookup runs.
    runtime: Option<tokio::runtime::Runtime>,
    known: HashMap<String, Known>,
    /// The socket failed: nothing is asked before then.
    down_until: Option<Instant>,
    failure_said: bool,
}

impl ContainerNames {
    /// Asks the containerd that listens on `socket`.
    pub fn new(socket: PathBuf) -> Self {
        Self { socket, runtime: None, known: HashMap::new(), down_until: None, failure_said: false }
    }

    /// Sets the pod, namespace and container name on `container` where containerd knows them.
    pub fn fill(&mut self, container: &mut Container) {
        let Some(id) = container.id.clone() else { return };
        if let Some(names) = self.names_of(&id) {
            names.apply(container);
        }
    }

    /// The names of container `id`, from the cache or asked now.
    fn names_of(&mut self, id: &str) -> Option<KubernetesNames> {
        let now = Instant::now();
        match self.known.get(id) {
            Some(Known::Found(names)) => return names.clone(),
            Some(Known::Missing { retry_at }) if *retry_at > now => return None,
            _ => {}
        }
        // No containerd here: nothing to ask, nothing to say.
        if self.down_until.is_some_and(|until| until > now) || !self.socket.exists() {
            return None;
        }
        let answer = self.ask(id);
        let known = match answer {
            Ok(Some(names)) => Known::Found(names),
            Ok(None) => Known::Missing { retry_at: now + RETRY_AFTER },
            Err(err) => {
                self.failed(&err);
                Known::Missing { retry_at: now + RETRY_AFTER }
            }
        };
        self.known.insert(id.to_owned(), known.clone());
        match known {
            Known::Found(names) => names,
            Known::Missing { .. } => None,
        }
    }

    /// One lookup, within the deadline: Ok(None) where no namespace has the container.
    fn ask(&mut self, id: &str) -> Result<Option<Option<KubernetesNames>>> {
        if self.runtime.is_none() {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the runtime that asks containerd")?;
            self.runtime = Some(runtime);
        }
        let runtime = self.runtime.as_ref().expect("made above");
        let socket = self.socket.clone();
        runtime.block_on(async {
            tokio::time::timeout(DEADLINE, labels_of(&socket, id))
                .await
                .map_err(|_| anyhow!("no answer within {} ms", DEADLINE.as_millis()))?
        })
    }

    /// Says once that the socket failed, and asks nothing of it for a while.
    fn failed(&mut self, err: &anyhow::Error) {
        self.down_until = Some(Instant::now() + RETRY_AFTER);
        if !self.failure_said {
            self.failure_said = true;
            eprintln!(
                "memtrace: asking containerd at {} for a container's Kubernetes names failed: {err:#}; \
                 containers are shown without pod, namespace and container names (tried again every {} s). \
                 Check that containerd runs and that memtrace may open its socket, or name the right one \
                 with --containerd-socket PATH",
                self.socket.display(),
                RETRY_AFTER.as_secs()
            );
        }
    }
}

/// The names of container `id` from containerd at `socket`, in whichever namespace has it
/// (`k8s.io`, the kubelet's, first); Ok(None) where none has it.
async fn labels_of(socket: &Path, id: &str) -> Result<Option<Option<KubernetesNames>>> {
    let channel = containerd_client::connect(socket).await.context("connecting")?;
    let mut namespaces = NamespacesClient::new(channel.clone())
        .list(ListNamespacesRequest::default())
        .await
        .context("listing its namespaces")?
        .into_inner()
        .namespaces
        .into_iter()
        .map(|namespace| namespace.name)
        .collect::<Vec<_>>();
    namespaces.sort_by_key(|name| name != "k8s.io");
    for namespace in namespaces {
        if let Some(labels) = container_labels(channel.clone(), &namespace, id).await? {
            return Ok(Some(KubernetesNames::from_labels(&labels)));
        }
    }
    Ok(None)
}

/// Container `id`'s labels in containerd namespace `namespace`; None where it has no such
/// container.
async fn container_labels(
    channel: Channel,
    namespace: &str,
    id: &str,
) -> Result<Option<HashMap<String, String>>> {
    let mut request = Request::new(GetContainerRequest { id: id.to_owned() });
    let value = namespace.parse().with_context(|| format!("namespace {namespace:?} as a gRPC header"))?;
    request.metadata_mut().insert("containerd-namespace", value);
    match ContainersClient::new(channel).get(request).await {
        Ok(reply) => Ok(Some(reply.into_inner().container.map(|c| c.labels).unwrap_or_default())),
        Err(status) if status.code() == Code::NotFound => Ok(None),
        Err(status) => {
            Err(status).with_context(|| format!("getting container {id} in namespace {namespace}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use containerd_client::services::v1::Container as ContainerdContainer;

    use super::*;

    fn container_with(labels: &[(&str, &str)]) -> ContainerdContainer {
        ContainerdContainer {
            id: "4f5e8c3a2b1d".into(),
            labels: labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            ..ContainerdContainer::default()
        }
    }

    #[test]
    fn kubernetes_labels_name_pod_namespace_and_container() {
        let kubelet = container_with(&[
            (POD_NAME, "web-7f9"),
            (POD_NAMESPACE, "shop"),
            (CONTAINER_NAME, "api"),
            ("io.kubernetes.pod.uid", "0a1b2c3d-1111-2222-3333-444455556666"),
            ("io.cri-containerd.kind", "container"),
        ]);
        let names = KubernetesNames::from_labels(&kubelet.labels).unwrap();
        assert_eq!(
            names,
            KubernetesNames {
                pod: Some("web-7f9".into()),
                namespace: Some("shop".into()),
                name: Some("api".into())
            }
        );
        let mut container = Container { id: Some("x".into()), ..Container::default() };
        names.apply(&mut container);
        assert_eq!(
            (container.pod.as_deref(), container.namespace.as_deref(), container.name.as_deref()),
            (Some("web-7f9"), Some("shop"), Some("api"))
        );
    }

    #[test]
    fn containers_without_kubernetes_labels_have_no_names() {
        assert_eq!(KubernetesNames::from_labels(&container_with(&[]).labels), None);
        let plain = container_with(&[("maintainer", "me"), (POD_NAME, "")]);
        assert_eq!(KubernetesNames::from_labels(&plain.labels), None, "an empty label names nothing");
        // A sandbox (pause) container carries the pod's labels but no container name.
        let sandbox = container_with(&[(POD_NAME, "web-7f9"), (POD_NAMESPACE, "shop")]);
        let names = KubernetesNames::from_labels(&sandbox.labels).unwrap();
        assert_eq!((names.pod.as_deref(), names.name), (Some("web-7f9"), None));
    }

    #[test]
    fn no_socket_asks_nothing_and_caches_nothing() {
        let mut names = ContainerNames::new("/nonexistent/containerd.sock".into());
        let mut container = Container { id: Some("ab".repeat(32)), ..Container::default() };
        names.fill(&mut container);
        assert_eq!(container.pod, None);
        assert!(names.runtime.is_none() && names.known.is_empty() && !names.failure_said);
    }

    #[test]
    fn a_failing_socket_is_said_once_and_not_asked_again_at_once() {
        let dir = tempfile::tempdir().unwrap();
        // A socket nobody listens on: connecting is refused.
        let path = dir.path().join("containerd.sock");
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        let mut names = ContainerNames::new(path);
        for seed in ["ab", "cd"] {
            let mut container = Container { id: Some(seed.repeat(32)), ..Container::default() };
            names.fill(&mut container);
            assert_eq!(container.name, None);
        }
        assert!(names.failure_said);
        assert!(names.down_until.is_some());
        assert_eq!(names.known.len(), 1, "the second container was not asked while the socket is down");
    }
}
