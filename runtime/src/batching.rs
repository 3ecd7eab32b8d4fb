//! The admission order every backend shares: waiting requests are admitted
//! in arrival order while the head request fits somewhere; the first that
//! does not fit stops admission, so a large request is never overtaken and
//! starved by small ones behind it. What "fits" means is the caller's: the
//! CPU twin and the simulator's split engines reserve the full KV (prompt +
//! maximum output); the simulator's unified engine charges SGLang's
//! estimate and retracts when KV runs out. All call [`admit_fifo`].

use std::collections::VecDeque;

/// Pops requests off the front of `waiting` while `place` finds room for
/// them (and places them); returns how many were admitted.
pub fn admit_fifo<T: Copy>(waiting: &mut VecDeque<T>, mut place: impl FnMut(T) -> bool) -> usize {
    let mut n = 0;
    while let Some(&id) = waiting.front() {
        if !place(id) {
            break;
        }
        waiting.pop_front();
        n += 1;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stops_at_the_first_request_that_does_not_fit() {
        let mut waiting: VecDeque<u32> = [3, 9, 1, 1].into_iter().collect();
        let mut free = 10;
        let mut admitted = Vec::new();
        let n = admit_fifo(&mut waiting, |need| {
            let fits = need <= free;
            if fits {
                free -= need;
                admitted.push(need);
            }
            fits
        });
        // 3 fits, 9 does not (7 left): the 1s behind it wait too.
        assert_eq!((n, admitted, waiting.len()), (1, vec![3], 3));
    }
}
