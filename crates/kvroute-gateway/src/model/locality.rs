//! Locality: where a worker runs relative to this router, as Ray Serve's `LocalityMixin`
//! (ray-project/ray `python/ray/serve/_private/request_router/request_router.py`) ranks
//! replicas — on the router's node, in its availability zone, or elsewhere.

use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// A worker's place relative to the router (lower is closer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Locality {
    /// On the router's node (label `node` equal to the router's).
    Node = 0,
    /// In the router's zone (label `zone` equal to the router's), another node.
    Zone = 1,
    /// Anywhere else, or not labelled.
    Other = 2,
}

impl Locality {
    /// From its `u8` form (anything above 1 is [`Locality::Other`]).
    pub fn from_u8(v: u8) -> Locality {
        match v {
            0 => Locality::Node,
            1 => Locality::Zone,
            _ => Locality::Other,
        }
    }
}

/// Where this router runs and which tiers it prefers (`[locality]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LocalityConfig {
    /// This router's node (Ray: the proxy's node id); none: no node preference.
    pub node: Option<String>,
    /// This router's availability zone; none: no zone preference.
    pub zone: Option<String>,
    /// Prefer workers on `node` (Ray Serve's `RAY_SERVE_PROXY_PREFER_LOCAL_NODE_ROUTING`, on
    /// for its proxies).
    pub prefer_local_node: bool,
    /// Prefer workers in `zone` (Ray Serve's `RAY_SERVE_PROXY_PREFER_LOCAL_AZ_ROUTING`).
    pub prefer_local_zone: bool,
    /// Labels of static workers by URL (`node`, `zone`); a worker registered in etcd
    /// carries its own in its record's `labels`, and these win over them.
    pub workers: BTreeMap<String, WorkerPlace>,
}

impl Default for LocalityConfig {
    fn default() -> Self {
        LocalityConfig {
            node: None,
            zone: None,
            prefer_local_node: true,
            prefer_local_zone: true,
            workers: BTreeMap::new(),
        }
    }
}

/// A worker's node and zone labels.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkerPlace {
    /// Its node.
    pub node: Option<String>,
    /// Its availability zone.
    pub zone: Option<String>,
}

impl WorkerPlace {
    /// From registration labels `node` and `zone`.
    pub fn from_labels(labels: &BTreeMap<String, String>) -> WorkerPlace {
        WorkerPlace { node: labels.get("node").cloned(), zone: labels.get("zone").cloned() }
    }
}

impl LocalityConfig {
    /// Whether any tier is preferred (a node or zone is set and its preference is on).
    pub fn active(&self) -> bool {
        (self.prefer_local_node && self.node.is_some()) || (self.prefer_local_zone && self.zone.is_some())
    }

    /// `place`'s rank: [`Locality::Node`] when its node is this router's and node
    /// preference is on, [`Locality::Zone`] when its zone is (or its node is, with zone
    /// preference only), else [`Locality::Other`].
    pub fn rank(&self, place: &WorkerPlace) -> Locality {
        let same = |a: &Option<String>, b: &Option<String>| a.is_some() && a == b;
        let same_node = same(&self.node, &place.node);
        if self.prefer_local_node && same_node {
            Locality::Node
        } else if self.prefer_local_zone && (same(&self.zone, &place.zone) || same_node) {
            Locality::Zone
        } else {
            Locality::Other
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn place(node: &str, zone: &str) -> WorkerPlace {
        WorkerPlace { node: Some(node.into()), zone: Some(zone.into()) }
    }

    #[test]
    fn ranks_follow_ray_serves_tiers_and_their_switches() {
        let mut c = LocalityConfig { node: Some("n1".into()), zone: Some("z1".into()), ..Default::default() };
        assert_eq!(c.rank(&place("n1", "z1")), Locality::Node);
        assert_eq!(c.rank(&place("n2", "z1")), Locality::Zone);
        assert_eq!(c.rank(&place("n3", "z2")), Locality::Other);
        assert_eq!(c.rank(&WorkerPlace::default()), Locality::Other, "unlabelled");
        c.prefer_local_node = false;
        assert_eq!(c.rank(&place("n1", "z1")), Locality::Zone, "same node counts as same zone");
        c.prefer_local_zone = false;
        assert!(!c.active());
        assert_eq!(c.rank(&place("n1", "z1")), Locality::Other);
        assert!(!LocalityConfig::default().active(), "nothing set: no preference");
    }
}
