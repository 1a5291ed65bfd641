//! `jwt.claims_to_policy`: a claim of a verified token (a string or an array of strings, such
//! as the user's groups or roles) chooses the user's ceiling, models and budget, in place of
//! the entry's (the budget in place of `users.budget`, over the same window). The verifier
//! ([`crate::jwt`]) reads the claim's values from a verified token; this module chooses. The first policy, in the config's order, whose value the claim holds applies; a
//! user whose claim holds none (or who has no such claim) keeps the entry's settings.

use std::sync::Arc;

use super::{ModelAllowlist, UsageBudget};
use crate::scheduler::Tier;

/// The claim read and the settings each of its values selects.
#[derive(Debug, Clone)]
pub struct ClaimsToPolicy {
    claim: String,
    policies: Vec<Arc<ClaimPolicy>>,
}

/// The settings of the users whose claim holds `value`.
#[derive(Debug)]
pub struct ClaimPolicy {
    /// The claim's value that selected it.
    pub value: String,
    /// The user's ceiling in place of the entry's, if it sets one.
    pub max_priority: Option<Tier>,
    /// The user's models in place of the entry's, if it lists some.
    pub models: Option<ModelAllowlist>,
    /// The user's budget in place of `users.budget`, if it sets one.
    pub budget: Option<UsageBudget>,
}

impl ClaimsToPolicy {
    /// From the wire, with each policy's budget as `budget` converts it, or what is wrong.
    pub fn try_new(
        wire: &oqp_proto::policy::v1::ClaimsToPolicy,
        budget: impl Fn(&oqp_proto::policy::v1::ClaimPolicy) -> Result<Option<UsageBudget>, String>,
    ) -> Result<Self, String> {
        if wire.claim.is_empty() {
            return Err("claims_to_policy.claim is empty".to_owned());
        }
        let mut policies = Vec::with_capacity(wire.policies.len());
        for policy in &wire.policies {
            use oqp_proto::policy::v1::Tier as Wire;
            let max_priority = match Wire::try_from(policy.max_priority) {
                Ok(Wire::Unspecified) => None,
                Ok(Wire::High) => Some(Tier::High),
                Ok(Wire::Normal) => Some(Tier::Normal),
                Ok(Wire::Low) => Some(Tier::Low),
                Err(_) => {
                    return Err(format!(
                        "claims_to_policy '{}': unknown tier {}",
                        policy.value, policy.max_priority
                    ));
                }
            };
            let models = (!policy.models.is_empty()).then(|| ModelAllowlist::new(&policy.models));
            policies.push(Arc::new(ClaimPolicy {
                value: policy.value.clone(),
                max_priority,
                models,
                budget: budget(policy)?,
            }));
        }
        Ok(Self {
            claim: wire.claim.clone(),
            policies,
        })
    }

    /// The claim whose values choose.
    pub fn claim(&self) -> &str {
        &self.claim
    }

    /// The settings of the policy for `value`, if there is one (a group an edge selected).
    pub fn group(&self, value: &str) -> Option<Arc<ClaimPolicy>> {
        self.policies
            .iter()
            .find(|policy| policy.value == value)
            .cloned()
    }

    /// The settings the claim's values `held` select, if any.
    pub fn select(&self, held: &[String]) -> Option<Arc<ClaimPolicy>> {
        self.policies
            .iter()
            .find(|policy| held.contains(&policy.value))
            .cloned()
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use oqp_proto::policy::v1 as wire;

    use super::*;

    fn claims_to_policy() -> ClaimsToPolicy {
        ClaimsToPolicy::try_new(
            &wire::ClaimsToPolicy {
                claim: "groups".into(),
                policies: vec![
                    wire::ClaimPolicy {
                        value: "admins".into(),
                        max_priority: wire::Tier::High as i32,
                        ..Default::default()
                    },
                    wire::ClaimPolicy {
                        value: "interns".into(),
                        max_priority: wire::Tier::Low as i32,
                        models: vec!["llama3.2*".into()],
                        ..Default::default()
                    },
                ],
            },
            |_| Ok(None),
        )
        .unwrap()
    }

    fn select(held: &[&str]) -> Option<String> {
        let held: Vec<String> = held.iter().map(|value| (*value).to_owned()).collect();
        claims_to_policy()
            .select(&held)
            .map(|policy| policy.value.clone())
    }

    #[test]
    fn the_first_listed_value_the_claim_holds_applies() {
        assert_eq!(select(&["interns"]).as_deref(), Some("interns"));
        // Config order decides, not the token's.
        assert_eq!(
            select(&["staff", "interns", "admins"]).as_deref(),
            Some("admins")
        );
        assert_eq!(select(&["staff"]), None);
        assert_eq!(select(&[]), None);
        let policy = claims_to_policy().select(&["interns".to_owned()]).unwrap();
        assert_eq!(policy.max_priority, Some(Tier::Low));
        let models = policy.models.as_ref().unwrap();
        assert!(models.allows("llama3.2:3b") && !models.allows("qwen3:8b"));
        // A group named by value, as a hop names the one its edge selected.
        let named = claims_to_policy().group("interns").unwrap();
        assert_eq!(named.max_priority, Some(Tier::Low));
        assert!(claims_to_policy().group("staff").is_none());
    }
}
