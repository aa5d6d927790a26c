"""The decode loop (`generator`): draft, verify, accept, roll back; the counters of one generation (`stats`) and the
text it makes (`text`: incremental detokenization, stop strings)."""
