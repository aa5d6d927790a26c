"""Verification: the full target scores a proposal in one forward (`scorer`), an acceptance rule decides what is
kept (`acceptance`: greedy, speculative sampling, typical), and the shallow verifier's cascade filters trees before
the full target sees them (`cascade`)."""
