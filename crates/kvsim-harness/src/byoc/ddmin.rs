//! Delta debugging over an op list whose last op fails: chunks of the ops before it are removed while the run
//! still fails the same check, halving the chunk when no removal holds (Zeller's ddmin, complements only).

use super::engine::EngineFailure;

/// Shrinks `ops` (the failing op last) within `budget` runs. `fails(candidate)` runs a candidate and answers the
/// ops of the run when it failed the same check (cut after its failing op), `None` when it did not.
pub fn shrink<O: Clone>(
    ops: &[O],
    budget: usize,
    mut fails: impl FnMut(Vec<O>) -> Result<Option<Vec<O>>, EngineFailure>,
) -> Result<Vec<O>, EngineFailure> {
    let mut best = ops.to_vec();
    let mut tries = 0;
    let mut chunk = best.len().div_ceil(2).max(1);
    while tries < budget {
        let mut i = 0;
        let mut removed_any = false;
        while tries < budget {
            // The failing op is always the last one: never removed on its own.
            let end = (i + chunk).min(best.len().saturating_sub(1));
            if i >= end {
                break;
            }
            let mut candidate = best.clone();
            candidate.drain(i..end);
            tries += 1;
            match fails(candidate)? {
                Some(ops) => {
                    best = ops;
                    removed_any = true;
                }
                None => i += chunk,
            }
        }
        if !removed_any {
            if chunk == 1 {
                break;
            }
            chunk /= 2;
        }
    }
    Ok(best)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_the_two_ops_that_fail_together() {
        // A run "fails" when it holds both 3 and 7 and ends with 9.
        let ops: Vec<u32> = (0..10).collect();
        let out = shrink(&ops, 1000, |c| Ok((c.contains(&3) && c.contains(&7) && c.last() == Some(&9)).then_some(c)))
            .unwrap();
        assert_eq!(out, vec![3, 7, 9]);
    }

    #[test]
    fn a_budget_of_zero_keeps_the_run() {
        let ops = vec![1, 2, 3];
        assert_eq!(shrink(&ops, 0, |c| Ok(Some(c))).unwrap(), ops);
    }
}
