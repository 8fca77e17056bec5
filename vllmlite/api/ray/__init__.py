"""Engine replicas on Ray Serve behind the same routes: the remote engine client, the replica
deployment, prefix-aware routing and the merged stats. Ray is imported only here."""
