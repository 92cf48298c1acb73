/* A complete C program on lbagent's client library: register a module, ask
 * for a node, "call" it, report the result, print the agent's view of the
 * route. Build and run (tools/capi/check.sh does, against a real agent):
 *
 *   cargo build --release -p lbagent-capi
 *   cc -O2 -Itools/capi tools/capi/example.c target/release/liblbagent_c.a \
 *      -lpthread -ldl -lm -o lbagent-example
 *   ./lbagent-example HEARTBEAT_PATH MODID CMDID
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#include <time.h>

#include "lbagent.h"

static void print_ip(uint32_t ip) {
    printf("%u.%u.%u.%u", ip >> 24, (ip >> 16) & 255, (ip >> 8) & 255, ip & 255);
}

static uint32_t elapsed_ms(const struct timespec *t0) {
    struct timespec t1;
    clock_gettime(CLOCK_MONOTONIC, &t1);
    return (uint32_t)((t1.tv_sec - t0->tv_sec) * 1000 + (t1.tv_nsec - t0->tv_nsec) / 1000000);
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s HEARTBEAT_PATH MODID CMDID\n", argv[0]);
        return 2;
    }
    uint32_t modid = (uint32_t)strtoul(argv[2], NULL, 10);
    uint32_t cmdid = (uint32_t)strtoul(argv[3], NULL, 10);

    LbClientOptions opts = {0}; /* every default: no cache, default paths */
    opts.heartbeat_path = argv[1];
    LbClient *client = NULL;
    int rc = lb_client_new(&opts, &client);
    if (rc != LB_OK) {
        fprintf(stderr, "lb_client_new: %s: %s\n", lb_status_name(rc), lb_last_error());
        return rc;
    }

    /* Pull the module's route before first use. */
    uint64_t version = 0;
    rc = lb_register(client, modid, cmdid, 2000, &version);
    if (rc != LB_OK) {
        fprintf(stderr, "lb_register: %s: %s\n", lb_status_name(rc), lb_last_error());
        lb_client_free(client);
        return rc;
    }
    printf("registered [%" PRIu32 ", %" PRIu32 "]: route version %" PRIu64 "\n", modid, cmdid,
           version);

    for (int i = 0; i < 5; i++) {
        LbHost host;
        /* 200 ms timeout; DAGOR business priority 1, user priority 0 (unset). */
        rc = lb_get_host(client, modid, cmdid, 200, 1, 0, &host);
        if (rc != LB_OK) {
            fprintf(stderr, "lb_get_host: %s: %s\n", lb_status_name(rc), lb_last_error());
            lb_client_free(client);
            return rc;
        }
        struct timespec t0;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        /* ... call the node here; this example pretends call 4 failed ... */
        int32_t call_result = (i == 3) ? -1 : 0;
        rc = lb_report(client, modid, cmdid, host, call_result, elapsed_ms(&t0));
        if (rc != LB_OK) {
            fprintf(stderr, "lb_report: %s: %s\n", lb_status_name(rc), lb_last_error());
        }
        printf("call %d: ", i + 1);
        print_ip(host.ip);
        printf(":%u (from %s), reported %s\n", host.port,
               host.source == LB_SOURCE_AGENT ? "the agent"
               : host.source == LB_SOURCE_CACHE ? "the cache" : "the static route file",
               call_result == 0 ? "success" : "failure");
    }
    lb_flush(client);

    LbNode nodes[16];
    size_t n = 0;
    rc = lb_get_route(client, modid, cmdid, 1000, nodes, 16, &n, &version);
    if (rc != LB_OK && rc != LB_ERR_BUFFER_TOO_SMALL) {
        fprintf(stderr, "lb_get_route: %s: %s\n", lb_status_name(rc), lb_last_error());
        lb_client_free(client);
        return rc;
    }
    printf("route of [%" PRIu32 ", %" PRIu32 "], version %" PRIu64 ", %zu nodes:\n", modid, cmdid,
           version, n);
    for (size_t i = 0; i < n && i < 16; i++) {
        printf("  ");
        print_ip(nodes[i].ip);
        printf(":%u overloaded=%u vsucc=%" PRIu32 " verr=%" PRIu32 " rsucc=%" PRIu32
               " rerr=%" PRIu32 "\n",
               nodes[i].port, nodes[i].overloaded, nodes[i].vsucc, nodes[i].verr, nodes[i].rsucc,
               nodes[i].rerr);
    }

    /* Consistent hashing: one key, the same node every time. */
    const char *key = "session-42";
    LbHost first, again;
    rc = lb_get_host_keyed(client, modid, cmdid, 1000, (const uint8_t *)key, strlen(key), &first);
    if (rc == LB_OK) {
        rc = lb_get_host_keyed(client, modid, cmdid, 1000, (const uint8_t *)key, strlen(key),
                               &again);
    }
    if (rc != LB_OK || first.ip != again.ip || first.port != again.port) {
        fprintf(stderr, "lb_get_host_keyed: %s: %s\n", lb_status_name(rc), lb_last_error());
        lb_client_free(client);
        return rc == LB_OK ? 1 : rc;
    }
    printf("key %s: ", key);
    print_ip(first.ip);
    printf(":%u, twice\n", first.port);

    /* A label selector: only nodes labelled version=canary (check.sh labels
       one node of the module so). */
    LbHost canary;
    for (int i = 0; i < 4; i++) {
        rc = lb_get_host_selecting(client, modid, cmdid, 1000, "version=canary", &canary);
        if (rc != LB_OK) {
            fprintf(stderr, "lb_get_host_selecting: %s: %s\n", lb_status_name(rc), lb_last_error());
            lb_client_free(client);
            return rc;
        }
        if (i > 0 && (canary.ip != first.ip || canary.port != first.port)) {
            fprintf(stderr, "lb_get_host_selecting: two nodes for one selector\n");
            lb_client_free(client);
            return 1;
        }
        first = canary;
    }
    printf("selector version=canary: ");
    print_ip(canary.ip);
    printf(":%u, every time\n", canary.port);

    /* An unknown module: the error code is the tool commands' exit status. */
    LbHost none;
    rc = lb_get_host(client, 999999, 1, 200, 0, 0, &none);
    printf("unknown module: status %d (%s)\n", rc, lb_status_name(rc));

    lb_client_free(client);
    return rc == LB_ERR_NO_SUCH_MODULE ? 0 : 1;
}
