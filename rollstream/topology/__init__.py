"""Redis topology, in one package: replication (Sentinel URLs, WAIT after EXEC), a run on a Redis Cluster, the
embedded replicated Redis (a primary, its replicas and 3 Sentinels), one data node's launcher, and the
replication lines `rollstream status` shows."""
