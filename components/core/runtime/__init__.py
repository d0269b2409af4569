"""How processes start, agree and end: the step CLI, the warm fork runtime, torch.distributed
set-up and the rank-0-decides agreement, ports."""
