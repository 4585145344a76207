"""Producer pacing (verl fully-async's budget with carry-over) as leases that only the trainer writes.

max_outstanding = train_batch_size * (1 + staleness_threshold). When the trainer publishes version v it
grants budget:v = max_outstanding - outstanding, where outstanding = dispatched - consumed (`dispatched`:
every prompt ever leased to a producer), and deletes every older budget. Producers never touch those
counters, and run no script: a producer asks by writing its own `producer:<name>:want` (the lease total it
wants to reach: what it has used plus one dispatch), and the trainer's `Leaser` (a thread of rank 0) moves
budget into the `lease` hash (producer -> prompts leased to it so far) up to each want, a few producers a
pass in turn. A producer dispatches only what its lease allows: prompt number `seq` of a producer (counted
from 0 over the whole run, as published) gets sample id `<name>-<seq>`, and the trainer refuses a sample
whose seq is outside its producer's lease. Hence outstanding never exceeds max_outstanding, whatever a
producer writes: a producer can use only its own lease, and a junk or duplicate entry consumes nothing.

Consumption is counted per prompt, once: `consumed:<name>` is a bitmap of that producer's seqs the trainer
has finished with (trained, dropped as stale, evicted, dead-lettered, skipped); a script sets the bits and
adds to `consumed` only the bits it flipped, and only for seqs inside the lease. So a retried call, a
commit replayed after a crash, a sample evicted again after a restart, and several ranks all count a prompt
once, and nothing a producer publishes beyond its lease or twice moves the pacing.

A producer that crashed (or lost Redis) mid-dispatch keeps its lease: its published count
(`producer:<name>:published`, moved with the publish) says where its next seq starts, so the restarted
producer dispatches the same prompts again under the same ids.

Leases are fair shares and expire on no progress (`expiry.LeaseExpiry`): whatever a producer wants, its
lease reaches at most its finished seqs plus its share of max_outstanding (`fair_shares`: the budget over the
run's producers until it has delivered something, then a share weighted by what it delivered), and a producer
with unfinished leased prompts that made no progress (seqs finished, entries the trainer holds, each counted
once) for 3 dispatch times (the slowest producer's, at most `rollout.lease_timeout_s`), e.g. a hoarder
writing any `want` and publishing nothing, or a dead producer, loses every unfinished seq of its lease: the
trainer's `_EXPIRE` script sets their bits in `consumed:<name>` (counted as consumed, once, like a dead
letter) and in `revoked:<name>`, logs an `expire` entry and tops the current version's budget up by their
room, so the others are leased it. The producer's lease total is never lowered (the bitmaps stay exact); a
sample of a revoked seq published late is dead-lettered by the trainer ("lease expired") and counts nothing,
so every seq still ends once. Until it makes progress again the producer is leased at most
`prompts_per_dispatch` unfinished prompts (`probation`), so a hoarder holds at most one dispatch per expiry.

Early consumption gives room back at once: samples evicted (filter_groups, rollout failures), dropped as
stale or dead-lettered count as consumed when the trainer meets them, and the current version's budget gets
their room back (a top-up: budget += n, never past max_outstanding - outstanding nor the grant's cap), else
sync mode (window = one global batch) would wait forever for their replacements. Trained samples are
counted in the step's commit; their room comes back with the next version's grant.
Memory back-pressure: while the run's unread stream data alone exceeds bus.redis_max_bytes (a retention
pass reports it), the trainer caps each grant at one global step's prompts (`cap`): producers then get no
more than the trainer consumes per version, so the backlog shrinks towards one step; they pause between
versions. Prompts leased under version g are fresh at step g+1, so one step's worth completes it.
Grants, top-ups and leases are logged on the trainer's `dispatch_log` stream, so the bound can be checked
from the log (`dispatch_entries`).

Liveness: a producer reads its lease before it loads the newest weights, so a prompt leased under version v
is never generated with weights older than v's predecessor, and the trainer publishes a version's weights
before it grants its budget.

Modules: `budget` (every write of the pacing, as Lua scripts the trainer runs: grants, leases, top-ups, the
consumed bitmaps; the producer's own `want` and published count), `counters` (what status, producers and the
audit read), `expiry` (fair shares and leases taken back: the expiry clock, the `revoked` bitmaps and the one
reader of them), `fence` (producers that flood Redis: fenced, their lease taken back, their unread excess
dropped). The trainer's lease loop that runs them, the `Leaser` thread, is trainer-only code:
consumers/trainer/leaser.py.
"""
