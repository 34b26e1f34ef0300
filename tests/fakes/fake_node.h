/*
 * Part of the GPU STAND-INS for tests (fake_libcuda.c, fake_nvml.c): one environment for every agent
 * of a DaemonSet, each node with its own GPUs. FAKE_NODE names the node (the DaemonSet gives it the
 * Node's name); a variable NAME_<FAKE_NODE>, where set, is that node's value of NAME.
 */
#ifndef FAKE_NODE_H
#define FAKE_NODE_H
#include <stdio.h>
#include <stdlib.h>

/* getenv(name), or where FAKE_NODE is set and name_<FAKE_NODE> too, that node's own value. */
static const char *node_getenv(const char *name)
{
	const char *node = getenv("FAKE_NODE"), *v;
	char key[256];

	if (node && *node && snprintf(key, sizeof(key), "%s_%s", name, node) < (int)sizeof(key) &&
	    (v = getenv(key)))
		return v;
	return getenv(name);
}
#endif
