/* DAGOR through the C ABI, against a real agent (tools/capi/check.sh runs
 * it on a module of ONE node, which it leaves without a level):
 *   - a service attaches its level to a response (lb_level_encode) and the
 *     caller reads it back (lb_level_decode);
 *   - the caller reports the call with that level (lb_report_with_level);
 *   - getHost by user id (lb_get_host_for_user): business priority 20 is
 *     rejected under the level (10, 128), 5 gets the node;
 *   - the open level (128, 128) clears it.
 * Exit status 0 when every step did what it should, 1 otherwise.
 *
 *   ./lbagent-dagor HEARTBEAT_PATH MODID CMDID
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lbagent.h"

static int failed = 0;

static void expect(const char *what, int got, int want) {
    if (got == want) {
        printf("ok   %s: %s\n", what, lb_status_name(got));
    } else {
        printf("FAIL %s: %s (%s), want %s\n", what, lb_status_name(got), lb_last_error(),
               lb_status_name(want));
        failed = 1;
    }
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s HEARTBEAT_PATH MODID CMDID\n", argv[0]);
        return 2;
    }
    uint32_t modid = (uint32_t)strtoul(argv[2], NULL, 10);
    uint32_t cmdid = (uint32_t)strtoul(argv[3], NULL, 10);
    LbClientOptions opts = {0};
    opts.heartbeat_path = argv[1];
    opts.user_hash_seed = 42;        /* the services' admission.user_hash_seed */
    opts.user_key_period_s = 86400;  /* and admission.user_key_period_s */
    LbClient *c = NULL;
    int rc = lb_client_new(&opts, &c);
    expect("lb_client_new", rc, LB_OK);
    if (rc != LB_OK) return 1;

    const char *user = "alice";
    size_t len = strlen(user);
    LbHost host;
    expect("lb_get_host_for_user (no level)",
           lb_get_host_for_user(c, modid, cmdid, 1000, 20, (const uint8_t *)user, len, &host),
           LB_OK);

    /* The service's side: its level into its response's two bytes. */
    uint8_t response[3] = {0, 0, 0x7f}; /* [B*, U*] then the service's own bytes */
    expect("lb_level_encode (10, 128)", lb_level_encode(10, 128, response), LB_OK);
    expect("lb_level_encode (0, 5)", lb_level_encode(0, 5, response + 2), LB_ERR_BAD_ARGUMENT);
    /* The caller's side: read it back and report it. */
    uint8_t b = 0, u = 0;
    expect("lb_level_decode", lb_level_decode(response, sizeof response, &b, &u), LB_OK);
    if (b != 10 || u != 128) {
        printf("FAIL decoded level (%u, %u), want (10, 128)\n", b, u);
        failed = 1;
    }
    expect("lb_level_decode (1 byte)", lb_level_decode(response, 1, &b, &u), LB_ERR_BAD_ARGUMENT);
    expect("lb_report_with_level (0, 7)",
           lb_report_with_level(c, modid, cmdid, host, 0, 3, 0, 7), LB_ERR_BAD_ARGUMENT);
    expect("lb_report_with_level (10, 128)",
           lb_report_with_level(c, modid, cmdid, host, 0, 3, b, u), LB_OK);

    /* The level lives admission.level_timeout_ms (3 s). */
    expect("lb_get_host_for_user B=20 under (10, 128)",
           lb_get_host_for_user(c, modid, cmdid, 1000, 20, (const uint8_t *)user, len, &host),
           LB_ERR_REJECTED);
    expect("lb_get_host_for_user B=5 under (10, 128)",
           lb_get_host_for_user(c, modid, cmdid, 1000, 5, (const uint8_t *)user, len, &host),
           LB_OK);
    expect("lb_get_host_for_user NULL id with a length",
           lb_get_host_for_user(c, modid, cmdid, 1000, 5, NULL, 3, &host), LB_ERR_BAD_ARGUMENT);

    /* The open level clears it: B=20 gets the node again. */
    expect("lb_report_with_level (128, 128)",
           lb_report_with_level(c, modid, cmdid, host, 0, 3, 128, 128), LB_OK);
    expect("lb_get_host_for_user B=20 after the open level",
           lb_get_host_for_user(c, modid, cmdid, 1000, 20, (const uint8_t *)user, len, &host),
           LB_OK);
    lb_client_free(c);
    return failed;
}
