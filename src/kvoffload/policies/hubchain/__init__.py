"""`hubchain`, the default eviction policy (registered as "hubchain").

policy.py    HubChainPolicy: the rules, their constants, the four orders
chain.py     its prefix-chain base: a store never breaks the chain it reads
learning.py  the learned shift: sampled reuse distances, the shadow LRU
loops.py     the hot loops over the orders, in Python; _hubchain_loops.c is
             their C twin (built by setup.py; optional)

Nothing is imported here: the registry loads policy.py on first use.
"""
