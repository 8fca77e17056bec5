"""The scheduling core: requests, blocks, the block manager, the scheduler and the batch contracts.
Imports nothing from engine/, worker/, models/, tokenizer/ or api/."""
