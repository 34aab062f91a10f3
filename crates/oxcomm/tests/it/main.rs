mod compression_kernels;
