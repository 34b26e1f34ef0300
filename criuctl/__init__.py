"""criuctl: freeze a running PyTorch job with CRIU and restore it elsewhere."""
