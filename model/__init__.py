"""Model side: config, checkpoints, the DSA + MoE decoder block, the MTP draft proposer, the target model, speculative decoding and the command line. Speaks to the GPU only through ``runtime``."""
