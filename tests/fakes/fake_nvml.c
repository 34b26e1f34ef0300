/*
 * A STAND-IN for NVIDIA's libnvidia-ml.so.1 (NVML), for tests only: it is not NVML and sees no GPU.
 *
 * It exports the few calls criuctl.gpu.gpus makes, answering from the environment at every call:
 *   FAKE_NVML_GPUS    "NAME=UUID[:TOTAL_BYTES[:FREE_BYTES]],..." e.g. "NVIDIA H200=GPU-1111...:150754820096";
 *                     free memory defaults to the total (an idle GPU);
 *                     unset: nvmlInit_v2 fails with NVML_ERROR_DRIVER_NOT_LOADED, as on a host without
 *                     the driver
 *   FAKE_NVML_DRIVER  what nvmlSystemGetDriverVersion returns (default "580.95.05")
 *   FAKE_NODE         a node's name: FAKE_NVML_GPUS_<FAKE_NODE>, where set, is that node's list (one
 *                     environment for every agent of a DaemonSet, each node with its own GPUs)
 * Device handles are the index + 1, cast to a pointer.
 */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fake_node.h"

typedef int nvmlReturn_t;
enum {
	NVML_SUCCESS = 0,
	NVML_ERROR_UNINITIALIZED = 1,
	NVML_ERROR_INVALID_ARGUMENT = 2,
	NVML_ERROR_NOT_FOUND = 6,
	NVML_ERROR_INSUFFICIENT_SIZE = 7,
	NVML_ERROR_DRIVER_NOT_LOADED = 9,
	NVML_ERROR_UNKNOWN = 999,
};

typedef struct nvmlDevice_st *nvmlDevice_t;
typedef struct {
	unsigned long long total, free, used;
} nvmlMemory_t;

#define DEFAULT_TOTAL 150754820096ULL /* an H200's 140 GiB as NVML reports it, roughly */

static int initialized;

/* The index-th GPU of FAKE_NVML_GPUS: 0 when found. */
static int gpu(unsigned int index, char *name, size_t name_size, char *uuid, size_t uuid_size,
	       unsigned long long *total, unsigned long long *free_bytes)
{
	const char *spec = node_getenv("FAKE_NVML_GPUS");
	char list[4096], *save_ptr = NULL, *tok;
	unsigned int i = 0;

	if (!spec)
		return -1;
	snprintf(list, sizeof(list), "%s", spec);
	for (tok = strtok_r(list, ",", &save_ptr); tok; tok = strtok_r(NULL, ",", &save_ptr), i++) {
		char *eq = strchr(tok, '='), *colon;

		if (i != index)
			continue;
		if (!eq)
			return -1;
		*eq++ = '\0';
		colon = strchr(eq, ':');
		if (colon)
			*colon++ = '\0';
		if (name)
			snprintf(name, name_size, "%s", tok);
		if (uuid)
			snprintf(uuid, uuid_size, "%s", eq);
		{
			char *end = NULL;
			unsigned long long t = colon ? strtoull(colon, &end, 10) : DEFAULT_TOTAL;

			if (total)
				*total = t;
			if (free_bytes)
				*free_bytes = end && *end == ':' ? strtoull(end + 1, NULL, 10) : t;
		}
		return 0;
	}
	return -1;
}

static unsigned int count(void)
{
	unsigned int n = 0;

	while (!gpu(n, NULL, 0, NULL, 0, NULL, NULL))
		n++;
	return n;
}

nvmlReturn_t nvmlInit_v2(void)
{
	if (!node_getenv("FAKE_NVML_GPUS"))
		return NVML_ERROR_DRIVER_NOT_LOADED;
	initialized++;
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlShutdown(void)
{
	if (!initialized)
		return NVML_ERROR_UNINITIALIZED;
	initialized--;
	return NVML_SUCCESS;
}

const char *nvmlErrorString(nvmlReturn_t result)
{
	switch (result) {
	case NVML_SUCCESS: return "Success";
	case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
	case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
	case NVML_ERROR_NOT_FOUND: return "Not Found";
	case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
	case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
	default: return "Unknown Error";
	}
}

static nvmlReturn_t copy_out(const char *value, char *out, unsigned int length)
{
	if (!out)
		return NVML_ERROR_INVALID_ARGUMENT;
	if (strlen(value) + 1 > length)
		return NVML_ERROR_INSUFFICIENT_SIZE;
	memcpy(out, value, strlen(value) + 1);
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length)
{
	const char *v = getenv("FAKE_NVML_DRIVER");

	if (!initialized)
		return NVML_ERROR_UNINITIALIZED;
	return copy_out(v && *v ? v : "580.95.05", version, length);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *n)
{
	if (!initialized)
		return NVML_ERROR_UNINITIALIZED;
	if (!n)
		return NVML_ERROR_INVALID_ARGUMENT;
	*n = count();
	return NVML_SUCCESS;
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device)
{
	if (!initialized)
		return NVML_ERROR_UNINITIALIZED;
	if (!device || index >= count())
		return NVML_ERROR_INVALID_ARGUMENT;
	*device = (nvmlDevice_t)(uintptr_t)(index + 1);
	return NVML_SUCCESS;
}

static int device_index(nvmlDevice_t device, unsigned int *index)
{
	uintptr_t v = (uintptr_t)device;

	if (!initialized || v == 0 || v > count())
		return -1;
	*index = (unsigned int)(v - 1);
	return 0;
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length)
{
	char value[256];
	unsigned int i;

	if (device_index(device, &i) || gpu(i, value, sizeof(value), NULL, 0, NULL, NULL))
		return NVML_ERROR_INVALID_ARGUMENT;
	return copy_out(value, name, length);
}

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length)
{
	char value[256];
	unsigned int i;

	if (device_index(device, &i) || gpu(i, NULL, 0, value, sizeof(value), NULL, NULL))
		return NVML_ERROR_INVALID_ARGUMENT;
	return copy_out(value, uuid, length);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory)
{
	unsigned int i;

	if (!memory || device_index(device, &i) || gpu(i, NULL, 0, NULL, 0, &memory->total, &memory->free))
		return NVML_ERROR_INVALID_ARGUMENT;
	memory->used = memory->total - memory->free;
	return NVML_SUCCESS;
}
