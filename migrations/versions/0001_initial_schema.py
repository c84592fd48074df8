"""initial schema

Revision ID: 0001
Revises: (none)
Create Date: 2026-11-29
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('alerts',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('rule', sa.String(length=128), nullable=False),
    sa.Column('fingerprint', sa.String(length=64), nullable=False),
    sa.Column('state', sa.String(length=16), nullable=False),
    sa.Column('severity', sa.String(length=16), nullable=False),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('annotations', sa.JSON(), nullable=False),
    sa.Column('value', sa.Float(), nullable=True),
    sa.Column('active_since', sa.Float(), nullable=False),
    sa.Column('fired_at', sa.Float(), nullable=True),
    sa.Column('resolved_at', sa.Float(), nullable=True),
    sa.Column('last_eval', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_alerts'))
    )
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.create_index('ix_alerts_rule_fingerprint', ['rule', 'fingerprint'], unique=False)
        batch_op.create_index(batch_op.f('ix_alerts_state'), ['state'], unique=False)

    op.create_table('decisions',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('tick', sa.Integer(), nullable=False),
    sa.Column('mode', sa.String(length=16), nullable=False),
    sa.Column('subject_kind', sa.String(length=16), nullable=False),
    sa.Column('subject', sa.String(length=128), nullable=False),
    sa.Column('field', sa.String(length=64), nullable=False),
    sa.Column('old_value', sa.Float(), nullable=True),
    sa.Column('new_value', sa.Float(), nullable=True),
    sa.Column('reason', sa.String(length=64), nullable=False),
    sa.Column('message', sa.Text(), nullable=False),
    sa.Column('arithmetic', sa.Text(), nullable=True),
    sa.Column('inputs', sa.JSON(), nullable=False),
    sa.Column('scores', sa.JSON(), nullable=False),
    sa.Column('routing_version', sa.Integer(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_decisions'))
    )
    with op.batch_alter_table('decisions', schema=None) as batch_op:
        batch_op.create_index('ix_decisions_subject_ts', ['subject', 'ts'], unique=False)
        batch_op.create_index(batch_op.f('ix_decisions_ts'), ['ts'], unique=False)

    op.create_table('instances',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('name', sa.String(length=128), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('url', sa.String(length=512), nullable=False),
    sa.Column('metrics_url', sa.String(length=512), nullable=True),
    sa.Column('labels', sa.JSON(), nullable=False),
    sa.Column('engine_id', sa.String(length=128), nullable=True),
    sa.Column('first_seen', sa.Float(), nullable=False),
    sa.Column('last_seen', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_instances')),
    sa.UniqueConstraint('name', name=op.f('uq_instances_name'))
    )
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_instances_pool'), ['pool'], unique=False)

    op.create_table('request_records',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('request_id', sa.String(length=128), nullable=False),
    sa.Column('trace_id', sa.String(length=32), nullable=True),
    sa.Column('endpoint', sa.String(length=64), nullable=True),
    sa.Column('stream', sa.Boolean(), nullable=True),
    sa.Column('p_instance', sa.String(length=128), nullable=True),
    sa.Column('d_instance', sa.String(length=128), nullable=True),
    sa.Column('p_pool', sa.String(length=128), nullable=True),
    sa.Column('d_pool', sa.String(length=128), nullable=True),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('http_status', sa.Integer(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('retries', sa.Integer(), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=True),
    sa.Column('completion_tokens', sa.Integer(), nullable=True),
    sa.Column('kv_blocks', sa.Integer(), nullable=True),
    sa.Column('kv_bytes', sa.BigInteger(), nullable=True),
    sa.Column('proxy_in', sa.Float(), nullable=False),
    sa.Column('p_sent', sa.Float(), nullable=True),
    sa.Column('p_done', sa.Float(), nullable=True),
    sa.Column('d_sent', sa.Float(), nullable=True),
    sa.Column('first_token', sa.Float(), nullable=True),
    sa.Column('done', sa.Float(), nullable=True),
    sa.Column('p_queue_s', sa.Float(), nullable=True),
    sa.Column('p_prefill_s', sa.Float(), nullable=True),
    sa.Column('d_queue_s', sa.Float(), nullable=True),
    sa.Column('d_prefill_s', sa.Float(), nullable=True),
    sa.Column('d_decode_s', sa.Float(), nullable=True),
    sa.Column('ttft_s', sa.Float(), nullable=True),
    sa.Column('tpot_s', sa.Float(), nullable=True),
    sa.Column('e2e_s', sa.Float(), nullable=True),
    sa.Column('slo_ttft_met', sa.Boolean(), nullable=True),
    sa.Column('slo_tpot_met', sa.Boolean(), nullable=True),
    sa.Column('slo_met', sa.Boolean(), nullable=True),
    sa.Column('lease_expiry_suspect', sa.Boolean(), nullable=False),
    sa.Column('attributes', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_request_records')),
    sa.UniqueConstraint('request_id', name=op.f('uq_request_records_request_id'))
    )
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.create_index('ix_request_records_d_instance_ts', ['d_instance', 'proxy_in'], unique=False)
        batch_op.create_index('ix_request_records_p_instance_ts', ['p_instance', 'proxy_in'], unique=False)
        batch_op.create_index(batch_op.f('ix_request_records_proxy_in'), ['proxy_in'], unique=False)
        batch_op.create_index('ix_request_records_status_ts', ['status', 'proxy_in'], unique=False)
        batch_op.create_index(batch_op.f('ix_request_records_trace_id'), ['trace_id'], unique=False)

    op.create_table('snapshots',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('instance', sa.String(length=128), nullable=False),
    sa.Column('pool', sa.String(length=128), nullable=False),
    sa.Column('role', sa.String(length=16), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('up', sa.Boolean(), nullable=False),
    sa.Column('scrape_duration_s', sa.Float(), nullable=True),
    sa.Column('error', sa.Text(), nullable=True),
    sa.Column('engines', sa.Integer(), nullable=True),
    sa.Column('process_start_ts', sa.Float(), nullable=True),
    sa.Column('kv_cache_usage', sa.Float(), nullable=True),
    sa.Column('num_running', sa.Float(), nullable=True),
    sa.Column('num_waiting', sa.Float(), nullable=True),
    sa.Column('waiting_capacity', sa.Float(), nullable=True),
    sa.Column('waiting_deferred', sa.Float(), nullable=True),
    sa.Column('kv_fetch_waiting_to_start', sa.Float(), nullable=True),
    sa.Column('kv_fetch_in_progress', sa.Float(), nullable=True),
    sa.Column('kv_fetch_completed_waiting', sa.Float(), nullable=True),
    sa.Column('prompt_tokens', sa.Float(), nullable=True),
    sa.Column('generation_tokens', sa.Float(), nullable=True),
    sa.Column('prompt_tokens_local_compute', sa.Float(), nullable=True),
    sa.Column('prompt_tokens_local_cache_hit', sa.Float(), nullable=True),
    sa.Column('prompt_tokens_external_kv_transfer', sa.Float(), nullable=True),
    sa.Column('prompt_tokens_cached', sa.Float(), nullable=True),
    sa.Column('prefix_cache_queries', sa.Float(), nullable=True),
    sa.Column('prefix_cache_hits', sa.Float(), nullable=True),
    sa.Column('external_prefix_cache_queries', sa.Float(), nullable=True),
    sa.Column('external_prefix_cache_hits', sa.Float(), nullable=True),
    sa.Column('preemptions', sa.Float(), nullable=True),
    sa.Column('requests_stop', sa.Float(), nullable=True),
    sa.Column('requests_length', sa.Float(), nullable=True),
    sa.Column('requests_abort', sa.Float(), nullable=True),
    sa.Column('requests_error', sa.Float(), nullable=True),
    sa.Column('requests_repetition', sa.Float(), nullable=True),
    sa.Column('admission_rejections_reqs', sa.Float(), nullable=True),
    sa.Column('admission_rejections_tokens', sa.Float(), nullable=True),
    sa.Column('ttft_sum', sa.Float(), nullable=True),
    sa.Column('ttft_count', sa.Float(), nullable=True),
    sa.Column('itl_sum', sa.Float(), nullable=True),
    sa.Column('itl_count', sa.Float(), nullable=True),
    sa.Column('e2e_sum', sa.Float(), nullable=True),
    sa.Column('e2e_count', sa.Float(), nullable=True),
    sa.Column('queue_sum', sa.Float(), nullable=True),
    sa.Column('queue_count', sa.Float(), nullable=True),
    sa.Column('nixl_xfer_time_sum', sa.Float(), nullable=True),
    sa.Column('nixl_xfer_time_count', sa.Float(), nullable=True),
    sa.Column('nixl_post_time_sum', sa.Float(), nullable=True),
    sa.Column('nixl_post_time_count', sa.Float(), nullable=True),
    sa.Column('nixl_bytes_sum', sa.Float(), nullable=True),
    sa.Column('nixl_bytes_count', sa.Float(), nullable=True),
    sa.Column('nixl_descriptors_sum', sa.Float(), nullable=True),
    sa.Column('nixl_descriptors_count', sa.Float(), nullable=True),
    sa.Column('nixl_failed_transfers', sa.Float(), nullable=True),
    sa.Column('nixl_failed_notifications', sa.Float(), nullable=True),
    sa.Column('nixl_kv_expired_reqs', sa.Float(), nullable=True),
    sa.Column('nixl_notifications_after_expiry', sa.Float(), nullable=True),
    sa.Column('histograms', sa.JSON(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_snapshots'))
    )
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.create_index('ix_snapshots_instance_ts', ['instance', 'ts'], unique=False)
        batch_op.create_index('ix_snapshots_pool_ts', ['pool', 'ts'], unique=False)
        batch_op.create_index(batch_op.f('ix_snapshots_ts'), ['ts'], unique=False)

    op.create_table('spans',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('trace_id', sa.String(length=32), nullable=False),
    sa.Column('span_id', sa.String(length=16), nullable=False),
    sa.Column('parent_span_id', sa.String(length=16), nullable=True),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('service', sa.String(length=256), nullable=True),
    sa.Column('kind', sa.Integer(), nullable=True),
    sa.Column('start_ts', sa.Float(), nullable=False),
    sa.Column('end_ts', sa.Float(), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('attributes', sa.JSON(), nullable=False),
    sa.Column('received_ts', sa.Float(), nullable=False),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_spans'))
    )
    with op.batch_alter_table('spans', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_spans_received_ts'), ['received_ts'], unique=False)
        batch_op.create_index(batch_op.f('ix_spans_start_ts'), ['start_ts'], unique=False)
        batch_op.create_index('ix_spans_trace_span', ['trace_id', 'span_id'], unique=False)

    op.create_table('weight_overrides',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('subject_kind', sa.String(length=16), nullable=False),
    sa.Column('subject', sa.String(length=128), nullable=False),
    sa.Column('weight', sa.Float(), nullable=True),
    sa.Column('drained', sa.Boolean(), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('created', sa.Float(), nullable=False),
    sa.Column('expires', sa.Float(), nullable=True),
    sa.Column('cleared', sa.Float(), nullable=True),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_weight_overrides'))
    )
    with op.batch_alter_table('weight_overrides', schema=None) as batch_op:
        batch_op.create_index('ix_weight_overrides_subject_active', ['subject', 'cleared'], unique=False)

    op.create_table('audit_events',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('ts', sa.Float(), nullable=False),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('action', sa.String(length=64), nullable=False),
    sa.Column('subject', sa.String(length=128), nullable=False),
    sa.Column('before', sa.JSON(), nullable=True),
    sa.Column('after', sa.JSON(), nullable=True),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('override_id', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['override_id'], ['weight_overrides.id'], name=op.f('fk_audit_events_override_id_weight_overrides')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_audit_events'))
    )
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_audit_events_ts'), ['ts'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('audit_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_audit_events_ts'))

    op.drop_table('audit_events')
    with op.batch_alter_table('weight_overrides', schema=None) as batch_op:
        batch_op.drop_index('ix_weight_overrides_subject_active')

    op.drop_table('weight_overrides')
    with op.batch_alter_table('spans', schema=None) as batch_op:
        batch_op.drop_index('ix_spans_trace_span')
        batch_op.drop_index(batch_op.f('ix_spans_start_ts'))
        batch_op.drop_index(batch_op.f('ix_spans_received_ts'))

    op.drop_table('spans')
    with op.batch_alter_table('snapshots', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_snapshots_ts'))
        batch_op.drop_index('ix_snapshots_pool_ts')
        batch_op.drop_index('ix_snapshots_instance_ts')

    op.drop_table('snapshots')
    with op.batch_alter_table('request_records', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_request_records_trace_id'))
        batch_op.drop_index('ix_request_records_status_ts')
        batch_op.drop_index(batch_op.f('ix_request_records_proxy_in'))
        batch_op.drop_index('ix_request_records_p_instance_ts')
        batch_op.drop_index('ix_request_records_d_instance_ts')

    op.drop_table('request_records')
    with op.batch_alter_table('instances', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_instances_pool'))

    op.drop_table('instances')
    with op.batch_alter_table('decisions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_decisions_ts'))
        batch_op.drop_index('ix_decisions_subject_ts')

    op.drop_table('decisions')
    with op.batch_alter_table('alerts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_alerts_state'))
        batch_op.drop_index('ix_alerts_rule_fingerprint')

    op.drop_table('alerts')
