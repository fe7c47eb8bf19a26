"""How a worker process starts: what runs before the training script, so a (re)start is fast.

`prestart` imports torch once and forks the worker's Baby child from there before the script runs;
`zygote` is the warm standby interpreter an agent keeps per group, which forks restarted workers
with torch already imported; `zygote_proxy` is the worker's side of that hand-over. They sit just
above the foundation: the process groups adopt the forked child, the launcher starts the standby.
"""
